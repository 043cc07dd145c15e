"""Benchmark the tile stage on generated slides: throughput, seconds per slide and peak memory.

For each slide size (default 20,000 x 20,000 px at 0.25 µm/px; add 50000 for the memory check)
a synthetic tumour slide is generated once and cached (``--cache``). Two copies (symlinks) are
tiled with the default settings (10x, 512 px, entropy 5 bits) for 1 and 2 workers, HDF5 and
Zarr, JPEG and raw pixels; each run is a fresh process so its peak RSS is its own. In the same
run the bare OpenSlide ``read_region`` rate is measured on the same patch list (the kept patches,
read one call each at the same pyramid level, single thread) before and after the tile runs.

    python benchmarks/bench_tile.py                       # 20k slide, 8 configurations
    python benchmarks/bench_tile.py --sizes 20000 50000   # also the 50k slide (generation takes minutes)

Columns: ``patches/s`` = kept patches per second of wall time over the run (tissue mask, reading,
entropy, encoding, writing, QC included; process start-up excluded); ``bare/s`` = the bare read
rate; ``ratio`` = patches/s / bare/s; ``RSS MB`` = peak resident memory of the run's process
(and its worker processes); ``store MB`` = size of one slide's store; ``reader`` = ``direct``
(tiled JPEG TIFF tiles decoded directly after a per-slide identity check against OpenSlide, the
default) or ``openslide`` (every pixel through OpenSlide, ``--openslide-only``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _slide(cache: Path, size: int) -> Path:
    from wsi_milssl.config import SynthConfig
    from wsi_milssl.synth import generate_slides

    folder = cache / f"slide_{size}"
    path = folder / "synth_000.tif"
    if not path.exists():
        t0 = time.perf_counter()
        print(f"generating a {size} x {size} px slide in {folder} (cached for later runs) ...", flush=True)
        generate_slides(SynthConfig(n_slides=1, seed=7, width_px=size, height_px=size, tumor_slide_fraction=1.0),
                        folder)
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def _copies(slide: Path, folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(n):
        link = folder / f"copy{k}.tif"
        if not link.exists():
            link.symlink_to(slide.resolve())
        out.append(link)
    return out


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def _child(args: argparse.Namespace) -> None:
    """One tile run in this process; prints a JSON line."""
    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import tile_slides

    config = TileConfig(magnification=args.magnification, patch_size_px=args.patch_size, format=args.format,
                        pixels=args.pixels, workers=args.workers, threads=args.threads,
                        direct_tiff_read=not args.openslide_only)
    slides = [Path(s) for s in args.child_slides]
    t0 = time.perf_counter()
    run = tile_slides(slides, args.child_out, config, overwrite=True)
    seconds = time.perf_counter() - t0
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({
        "seconds": seconds, "n_patches": sum(r.n_patches for r in run.results),
        "slide_seconds": [r.seconds for r in run.results], "status": [r.status for r in run.results],
        "errors": [r.error for r in run.results],
        "rss_mb": max(rss_self, rss_children), "store": run.results[0].store_path,
    }))


def _bare_rate(store_path: str, slide: Path) -> tuple[float, int]:
    """Bare OpenSlide read_region patches/s over the kept patches of a store (one call each)."""
    import openslide

    from wsi_milssl.store import open_store

    with open_store(store_path) as store:
        coords = store.coords
        level = int(store.attrs["level"])
        size = int(store.attrs["patch_size_level"])
    osr = openslide.OpenSlide(str(slide))
    try:
        t0 = time.perf_counter()
        for x, y in coords:
            osr.read_region((int(x), int(y)), level, (size, size))
        dt = time.perf_counter() - t0
    finally:
        osr.close()
    return (len(coords) / dt if dt > 0 else float("nan")), len(coords)


def _size_of(path: str) -> float:
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e6
    return p.stat().st_size / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000], help="slide sides in level-0 px")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/wsi_milssl_bench"), help="slide cache folder")
    parser.add_argument("--magnification", type=float, default=10.0)
    parser.add_argument("--patch-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="reader threads per worker")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--formats", nargs="+", default=["h5", "zarr"])
    parser.add_argument("--pixels", nargs="+", default=["jpeg", "raw"])
    parser.add_argument("--copies", type=int, default=2, help="slides per run (symlinked copies)")
    parser.add_argument("--openslide-only", action="store_true",
                        help="(child runs) read every pixel through OpenSlide; the table adds one such row for "
                             "1 worker, the first format and the first pixel mode")
    # internal: one run in a child process
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-slides", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="h5", help=argparse.SUPPRESS)
    parser.add_argument("--child-pixels", dest="pixels_one", default="jpeg", help=argparse.SUPPRESS)
    parser.add_argument("--child-workers", dest="workers_one", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.pixels, args.workers = args.pixels_one, args.workers_one
        _child(args)
        return

    rows = []
    for size in args.sizes:
        slide = _slide(args.cache, size)
        _warm(slide)
        slides = _copies(slide, args.cache / f"run_{size}" / "slides", args.copies)
        bare: list[float] = []
        results = []
        runs = [(w, f, p, "direct") for w in args.workers for f in args.formats for p in args.pixels]
        runs.append((1, args.formats[0], args.pixels[0], "openslide"))
        for workers, fmt, pixels, reader in runs:
            out = args.cache / f"run_{size}" / f"out_{workers}_{fmt}_{pixels}_{reader}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, __file__, "--child", "--child-slides", *map(str, slides),
                   "--child-out", str(out), "--format", fmt, "--child-pixels", pixels,
                   "--child-workers", str(workers), "--threads", str(args.threads),
                   "--magnification", str(args.magnification), "--patch-size", str(args.patch_size)]
            if reader == "openslide":
                cmd.append("--openslide-only")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(f"tile run failed: {' '.join(cmd)}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            if any(s != "ok" for s in res["status"]):
                raise SystemExit(f"tile run had failures: {res['errors']}")
            if not bare:
                bare.append(_bare_rate(res["store"], slide)[0])
            results.append((workers, fmt, pixels, reader, res, out))
        bare.append(_bare_rate(results[0][4]["store"], slide)[0])
        bare_rate = float(np.mean(bare))
        for workers, fmt, pixels, reader, res, out in results:
            rate = res["n_patches"] / res["seconds"]
            rows.append({
                "size": size, "workers": workers, "threads": args.threads, "reader": reader, "format": fmt,
                "pixels": pixels,
                "slides": len(slides), "patches": res["n_patches"] // len(slides),
                "s/slide": res["seconds"] / len(slides), "patches/s": rate, "bare/s": bare_rate,
                "ratio": rate / bare_rate, "RSS MB": res["rss_mb"], "store MB": _size_of(res["store"]),
            })
        print(f"bare read_region rate on the {size}-px slide: "
              + ", ".join(f"{b:.0f}" for b in bare) + " patches/s (before, after)", flush=True)

    head = ["size", "workers", "threads", "reader", "format", "pixels", "slides", "patches", "s/slide",
            "patches/s", "bare/s", "ratio", "RSS MB", "store MB"]
    fmt_row = "{:>6} {:>7} {:>7} {:>9} {:>6} {:>6} {:>6} {:>7} {:>8} {:>9} {:>7} {:>6} {:>7} {:>8}"
    print()
    print(fmt_row.format(*head))
    for r in rows:
        print(fmt_row.format(r["size"], r["workers"], r["threads"], r["reader"], r["format"], r["pixels"],
                             r["slides"],
                             r["patches"], f"{r['s/slide']:.2f}", f"{r['patches/s']:.1f}", f"{r['bare/s']:.1f}",
                             f"{r['ratio']:.2f}", f"{r['RSS MB']:.0f}", f"{r['store MB']:.1f}"))
    print(f"\nCPU cores: {os.cpu_count()}; load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
