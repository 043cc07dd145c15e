"""How far batched device JPEG decoding (``--decode device``) is from the readers' PIL decoding, and how fast.

    python benchmarks/nvjpeg_vs_pil.py STORE_DIR [--patches 4096] [--batch 256]

Reads the stored JPEG bytes of up to ``--patches`` patches from the HDF5/Zarr patch stores in
``STORE_DIR`` (what ``wsi-milssl tile`` wrote), decodes them with PIL (what the readers do, through
the store) and with :func:`wsi_milssl.runtime.decode_jpeg_batch` on the device (nvJPEG on CUDA,
libjpeg-turbo on the CPU), and prints the pixel differences (levels of 0-255: mean, percentiles,
maximum) and both decode rates. On the CPU the two decoders are the same library, so the differences
are 0.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from wsi_milssl.runtime import decode_jpeg_batch
from wsi_milssl.store import open_store


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stores", type=Path, help="folder of patch stores (JPEG pixels)")
    p.add_argument("--patches", type=int, default=4096, help="patches to compare")
    p.add_argument("--batch", type=int, default=256, help="patches per device decode call")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    paths = sorted(q for q in args.stores.iterdir() if q.suffix in (".h5", ".zarr"))
    encoded: list[bytes] = []
    decoded: list[np.ndarray] = []
    pil_s = 0.0
    for path in paths:
        if len(encoded) >= args.patches:
            break
        with open_store(path) as store:
            n = min(len(store), args.patches - len(encoded))
            idx = np.arange(n)
            encoded += list(store.read_jpeg(idx))
            t0 = time.perf_counter()
            decoded.append(np.asarray(store.read_patches(idx)))
            pil_s += time.perf_counter() - t0
    if not encoded:
        raise SystemExit(f"{args.stores}: no patch stores with JPEG pixels")
    ref = np.concatenate(decoded)
    device = torch.device(args.device)
    data = [torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy()) for b in encoded]
    decode_jpeg_batch(data[:args.batch], device)  # warm-up (library handles, kernels)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    parts = [decode_jpeg_batch(data[i:i + args.batch], device) for i in range(0, len(data), args.batch)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    dev_s = time.perf_counter() - t0
    got = torch.cat(parts).cpu().numpy()
    diff = np.abs(got.astype(np.int16) - ref.astype(np.int16)).astype(np.float32)
    per_patch = diff.reshape(len(diff), -1).mean(axis=1)
    n, side = len(ref), ref.shape[1]
    print(f"{n} patches of {side} px from {len(paths)} stores in {args.stores}; device {device}")
    print("| measure | value |\n|---|---:|")
    print(f"| mean abs difference (levels) | {diff.mean():.3f} |")
    for q in (50, 99, 99.9):
        print(f"| {q}th percentile of abs difference | {np.percentile(diff, q):.0f} |")
    print(f"| max abs difference | {diff.max():.0f} |")
    print(f"| pixels differing by more than 8 | {100 * (diff > 8).mean():.3f} % |")
    print(f"| worst patch's mean abs difference | {per_patch.max():.3f} |")
    print(f"| PIL decode through the store, 1 process (patches/s) | {n / pil_s:.0f} |")
    print(f"| decode_jpeg_batch on {device.type}, batch {args.batch} (patches/s) | {n / dev_s:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
