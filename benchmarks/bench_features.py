"""Feature-stage throughput: ``wsi-milssl features`` beside the encoder's bare forward on the same patches.

    python benchmarks/bench_features.py                    # CPU: the demo's 12 slides (8192 px, 10x, 64-px patches)
    python benchmarks/bench_features.py --repeat 7         # more alternating runs on a noisy machine
    python benchmarks/bench_features.py --preset gpu       # CUDA: 14 slides of 24,576 px, 20x, 224 px, batch 256

1. Slides and stores. Demo-like slides (as many as the demo's two sets, 8192 px) are generated (``wsi-milssl synth --slides 1 --seed K``, cached
   in ``--cache``; even seeds tumour, odd normal) and tiled once into JPEG stores with the demo's
   recipe (10x, 64-px patches, entropy 5 bits, tissue >= 0.5). The ``gpu`` preset: the 14 slides of
   24,576 px of ``bench_heatmap.py --preset gpu14``, tiled at 20x with 224-px patches.
2. The stage. ``python -m wsi_milssl features STORES --encoder resnet50_trunc --weights random``
   (random weights: speed does not depend on them) runs in a child process with ``--overwrite``;
   reported: patches/s from the first slide opened to the last file written (as the command prints
   it), the whole command's wall time (imports, building the encoder, BatchNorm folding) and its CPU
   seconds (``wait4``: the command and its reaped readers).
3. The bare forward. In this process, the same encoder with the same runtime (``FeatureModel``:
   bfloat16 autocast and channels_last on the CPU, BatchNorm folded, the same torch threads) runs on
   the same patches, read from the stores beforehand and turned into what the readers would hand over
   (on the CPU the normalised bfloat16 model input; on CUDA the uint8 pixels, already on the GPU and
   normalised there as in the stage), in the same batches (per slide, ``--batch-size``, each slide's last batch smaller on the
   CPU and padded on CUDA, as the stage does). On CUDA the batches repeat until ``--min-seconds``
   have passed and the GPU is synchronised only at the end.

Stage and bare runs alternate ``--repeat`` times (the machine may be shared); the medians and the
range are reported, and the ratio of the medians is the figure: the stage's patches/s over the bare
forward's (the ratio of each pair, stage and bare forward a few seconds apart, is printed too).
Other processes' load is measured during every run (CPU time of the whole machine from
``/proc/stat`` less this benchmark's own): a pair in which it exceeds ``--max-foreign`` of the
machine is run again (up to ``--max-tries`` times) and left out of the medians, and the report
says how many were. ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from _slides import build_slides  # benchmarks/_slides.py

PRESETS = {
    # demo-like: the demo's slide size and tile recipe (pipelines/demo.toml)
    "cpu": {"n_slides": 12, "size": 8192, "magnification": 10.0, "patch_size": 64, "batch_size": 64},
    "gpu": {"n_slides": 14, "size": 24576, "magnification": 20.0, "patch_size": 224, "batch_size": 256},
}


def build_stores(slides: list[Path], folder: Path, *, magnification: float, patch_size: int) -> list[Path]:
    """JPEG stores of ``slides`` (tiled once, reused): the demo's entropy and tissue settings."""
    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import tile_slides

    config = TileConfig(magnification=magnification, patch_size_px=patch_size, entropy_threshold_bits=5.0,
                        min_tissue=0.5, workers=max(1, min(len(slides), (os.cpu_count() or 1))))
    t0 = time.perf_counter()
    run = tile_slides(slides, folder, config)
    if not run.ok:
        raise SystemExit(f"tiling failed: see {run.status_csv}")
    print(f"stores: {sum(r.n_patches for r in run.results)} patches in {len(run.results)} stores "
          f"({time.perf_counter() - t0:.1f} s; {folder})", flush=True)
    return sorted(folder.glob("*.h5"))


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (``/proc/stat``; 0 where there is none)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _foreign(busy0: float, busy1: float, own_cpu_s: float, wall_s: float) -> float:
    """Share of the machine's CPU capacity that other processes used during a run."""
    capacity = (os.cpu_count() or 1) * max(wall_s, 1e-9)
    return max(0.0, (busy1 - busy0 - own_cpu_s) / capacity)


def _descendant_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of every living descendant of ``root`` (its reader fork server and
    readers, which the command does not reap), from ``/proc``."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for child, parent in parents.items():
            if parent == pid:
                out[child] = cpu[child]
                todo.append(child)
    return out


def run_stage(stores: list[Path], out: Path, *, batch_size: int, workers: int, threads: int, dtype: str) -> dict:
    """``wsi-milssl features`` in a child process; its own seconds (first slide to last file), wall, CPU,
    and the other processes' share of the machine meanwhile."""
    cmd = [sys.executable, "-m", "wsi_milssl", "features", *map(str, stores), "--out", str(out), "--encoder",
           "resnet50_trunc", "--weights", "random", "--overwrite", "--batch-size", str(batch_size), "--workers",
           str(workers), "--threads", str(threads), "--dtype", dtype]
    t0, busy0 = time.perf_counter(), _busy_seconds()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, float] = {}
    stop = threading.Event()

    def sample() -> None:  # the readers' CPU, which the command's rusage does not hold (every 0.5 s)
        while not stop.is_set():
            for pid, value in _descendant_cpu(proc.pid).items():
                seen[pid] = max(seen.get(pid, 0.0), value)
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall, busy1 = time.perf_counter() - t0, _busy_seconds()
    stop.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the features command failed:\n{output}")
    found = re.search(r"; (\d+) patches in ([0-9.]+) s", output)
    if found is None:
        raise SystemExit(f"the features command did not print its time:\n{output}")
    n, seconds = int(found.group(1)), float(found.group(2))
    cpu = usage.ru_utime + usage.ru_stime + sum(seen.values())
    return {"n_patches": n, "stage_s": seconds, "patches_per_s": n / seconds, "wall_s": wall, "cpu_s": cpu,
            "foreign": _foreign(busy0, busy1, cpu, wall)}


class Bare:
    """The encoder of the stage, with its runtime, on the stores' patches prepared as the readers would."""

    def __init__(self, stores: list[Path], *, batch_size: int, workers: int, threads: int, dtype: str) -> None:
        import torch

        from wsi_milssl.config import FeaturesConfig
        from wsi_milssl.features import load_feature_model
        from wsi_milssl.store import open_store
        from wsi_milssl.tiling import TilingPlan

        config = FeaturesConfig(encoder="resnet50_trunc", weights="random", batch_size=batch_size,
                                num_workers=workers, threads=threads, dtype=dtype)
        with open_store(stores[0]) as store:
            plan = TilingPlan.from_json(str(store.attrs["tiling_plan"]))
        self.model = load_feature_model(config, plan=plan)
        self.device = self.model.runtime.device
        cuda = self.device.type == "cuda"
        self.batches = []
        for path in stores:
            with open_store(path) as store:
                pixels = torch.from_numpy(np.asarray(store.read_patches(np.arange(len(store)))))
            for start in range(0, len(pixels), batch_size):
                u8 = pixels[start:start + batch_size]
                n = len(u8)
                if cuda:
                    if n < batch_size:  # the stage pads a slide's last batch on CUDA
                        u8 = torch.cat([u8, u8.new_zeros((batch_size - n,) + tuple(u8.shape[1:]))])
                    x = u8.to(self.device)  # uint8 on the GPU, normalised there as in the stage
                else:
                    x = self.model.worker_preprocess(u8)  # the readers' bfloat16 model input
                self.batches.append((x, n))
        self.n = sum(n for _, n in self.batches)

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, *, min_seconds: float) -> dict:
        for x, _ in self.batches[:2]:  # warm-up: oneDNN primitives, cuDNN plans
            self.model.forward_batch(x)
        self.sync()
        t0, c0, busy0, done = time.perf_counter(), time.process_time(), _busy_seconds(), 0
        while True:
            for x, n in self.batches:
                self.model.forward_batch(x)
                done += n
            if self.device.type != "cuda":
                break
            self.sync()
            if time.perf_counter() - t0 >= min_seconds:
                break
        self.sync()
        dt, cpu, busy1 = time.perf_counter() - t0, time.process_time() - c0, _busy_seconds()
        return {"n_patches": done, "seconds": dt, "patches_per_s": done / dt, "cpu_s": cpu,
                "foreign": _foreign(busy0, busy1, cpu, dt)}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="slide set and tile recipe")
    p.add_argument("--slides", type=int, default=None, help="number of slides [preset]")
    p.add_argument("--size", type=int, default=None, help="slide side in px at 0.25 µm/px [preset]")
    p.add_argument("--batch-size", type=int, default=None, help="patches per encoder call [preset]")
    p.add_argument("--workers", type=int, default=-1, help="reader processes of the stage (-1 auto)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default), stage and bare")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="feature dtype in the files")
    p.add_argument("--repeat", type=int, default=5, help="alternating stage/bare runs; medians reported")
    p.add_argument("--min-seconds", type=float, default=3.0, help="CUDA: time the bare forward at least this long")
    p.add_argument("--max-foreign", type=float, default=0.1,
                   help="run a pair again when other processes used more than this share of the machine")
    p.add_argument("--max-tries", type=int, default=4, help="tries per pair before it is kept, flagged as noisy")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "wsi_milssl_bench",
                   help="folder for generated slides and stores (reused)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    n_slides, size = args.slides or preset["n_slides"], args.size or preset["size"]
    batch = args.batch_size or preset["batch_size"]

    args.cache.mkdir(parents=True, exist_ok=True)
    slides, _ = build_slides(args.cache, n=n_slides, size=size)
    folder = args.cache / f"feature_stores_{size}_{n_slides}_{preset['magnification']:g}x_{preset['patch_size']}px"
    stores = sorted(folder.glob("*.h5")) if (folder / "tile_status.csv").exists() else []
    if len(stores) != n_slides:
        stores = build_stores(slides, folder, magnification=preset["magnification"], patch_size=preset["patch_size"])

    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    bare = Bare(stores, batch_size=batch, workers=args.workers, threads=args.threads, dtype=args.dtype)
    runtime = bare.model.runtime.describe()
    gpu = torch.cuda.get_device_name(0) if bare.device.type == "cuda" else ""
    print(f"{bare.n} patches of {preset['patch_size']} px in {len(stores)} stores; resnet50_trunc (random weights), "
          f"batch {batch}; {runtime}; torch threads {torch.get_num_threads()}; {os.cpu_count()} CPUs"
          f"{'; ' + gpu if gpu else ''}", flush=True)
    stage_runs, bare_runs, noisy = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_features_") as tmp:
        for i in range(args.repeat):
            for attempt in range(1, args.max_tries + 1):
                s = run_stage(stores, Path(tmp) / "feats", batch_size=batch, workers=args.workers,
                              threads=args.threads, dtype=args.dtype)
                b = bare.run(min_seconds=args.min_seconds)
                if s["n_patches"] != bare.n:
                    raise SystemExit(f"the stage embedded {s['n_patches']} patches, the stores hold {bare.n}")
                clean = max(s["foreign"], b["foreign"]) <= args.max_foreign
                print(f"pair {i + 1}/{args.repeat} try {attempt}: stage {s['patches_per_s']:.1f} patches/s (wall "
                      f"{s['wall_s']:.1f} s), bare forward {b['patches_per_s']:.1f} patches/s, ratio "
                      f"{s['patches_per_s'] / b['patches_per_s']:.3f}; other load {s['foreign']:.0%} / {b['foreign']:.0%}"
                      f"{'' if clean else ' (noisy)'}", flush=True)
                if clean:
                    stage_runs.append(s)
                    bare_runs.append(b)
                    break
                noisy.append((s, b))
        if not stage_runs:
            print("every pair ran beside other load; reporting the noisy ones", flush=True)
            stage_runs, bare_runs = [s for s, _ in noisy], [b for _, b in noisy]

    stage_rate = statistics.median(r["patches_per_s"] for r in stage_runs)
    bare_rate = statistics.median(r["patches_per_s"] for r in bare_runs)
    ratios = [s["patches_per_s"] / b["patches_per_s"] for s, b in zip(stage_runs, bare_runs)]
    wall_rate = statistics.median(bare.n / r["wall_s"] for r in stage_runs)
    print()
    print(f"| measure ({len(stage_runs)} alternating pairs; median (min-max)) | patches/s | vs bare forward |")
    print("|---|---:|---:|")
    print(f"| bare forward, same patches and batches | {_spread([r['patches_per_s'] for r in bare_runs])} | 1.00 |")
    print(f"| features stage (first slide to last file) | {_spread([r['patches_per_s'] for r in stage_runs])} | "
          f"{stage_rate / bare_rate:.2f} |")
    print(f"| whole command (wall, from process start) | {wall_rate:.1f} | {wall_rate / bare_rate:.2f} |")
    print(f"\nratio per pair: {', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f}); "
          f"{len(noisy)} pair(s) beside more than {args.max_foreign:.0%} other load left out")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                         "n_slides": n_slides, "size": size, "batch_size": batch, **preset},
            "runtime": runtime, "gpu": gpu, "cpu_count": os.cpu_count(), "n_patches": bare.n,
            "stage": stage_runs, "bare": bare_runs, "ratio_of_medians": stage_rate / bare_rate,
            "ratios": ratios, "noisy_pairs": [{"stage": s, "bare": b} for s, b in noisy]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
