"""Heatmap throughput and memory: the whole ``wsi-milssl heatmap`` command beside the bare model forward.

    python benchmarks/bench_heatmap.py                       # 50,000 px slide, ResNet18 at 0.5 µm/px, 224 px
    python benchmarks/bench_heatmap.py --size 16384 --repeat 1   # a quick look (startup costs weigh more)
    python benchmarks/bench_heatmap.py --preset gpu14        # GPU: 14 slides of 24,576 px made in parallel
    python benchmarks/bench_heatmap.py --iou-checkpoint runs/r1/best.pt --iou-slides slides/

Presets: ``cpu`` (the default) is one generated slide of ``--size`` px; ``gpu14`` is the GPU set of
the issue tracker: 14 slides of 24,576 x 24,576 px at 0.25 µm/px (``synth --slides 1 --seed K``, seeds
0-13, made in parallel; 7 tumour, 7 normal), batch 256, and all of them in one heatmap command.

1. Throughput. A slide is generated with ``wsi_milssl.synth`` (cached in ``--cache``), a checkpoint
   of a ResNet18 (random weights: speed does not depend on them) with the tiling settings is written,
   and ``python -m wsi_milssl heatmap`` runs on it (on all of them) in a child process. Reported:
   patches/s of the whole command (wall time from process start to exit: imports, tissue mask,
   tiling, reading, inference, PNG and exports) and of the slides (from the first slide opened to the
   last file written, as the command prints it); then, in
   this process, the bare forward rate of the same model with the same runtime (bfloat16 autocast,
   channels_last, threads) on the same number of ready-made input tensors in batches of the same
   size, twice: the network the command runs (BatchNorm folded into the convolutions) and the model
   as trained (``--no-fuse-batchnorm``). On CUDA the bare forward runs full batches only (the command
   pads a slide's last batch to one shape too), waits for the GPU only at the end, and repeats until
   ``--min-seconds`` have passed. Runs alternate ``--repeat`` times (the machine may be shared); the
   median is reported.
   CPU seconds per patch (the command with its DataLoader workers, from ``wait4``; the bare forward
   from ``process_time``) are printed too: unlike wall time they barely move with other load.
2. Memory. Peak RSS of the command's main process (``wait4``) and the peaks of the summed RSS and
   summed PSS of the process tree (main, reader fork server and readers; RSS sampled every 0.1 s,
   PSS every 2 s; RSS counts shared pages once per process, PSS splits them), on the throughput
   slides and, with
   ``--big``, on a generated ``--big`` x ``--big`` px slide.
3. IoU (optional). With a trained checkpoint and a folder of generated slides with their ASAP XML:
   per tumour slide, grid cells with p >= 0.5 against cells whose exact tumour fraction is >= 0.5.

Prints tables; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import csv
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


def _synth_slide(cache: Path, size: int, *, seed: int) -> Path:
    from wsi_milssl.config import SynthConfig
    from wsi_milssl.synth import generate_slides

    folder = cache / f"synth_{size}_s{seed}"
    slide = folder / "synth_000.tif"
    if not slide.exists():
        t0 = time.perf_counter()
        print(f"generating a {size} x {size} px slide in {folder} ...", flush=True)
        generate_slides(SynthConfig(n_slides=1, seed=seed, width_px=size, height_px=size, tumor_slide_fraction=1.0),
                        folder)
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    return slide


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""


def _dims(slide: Path) -> list[int]:
    from wsi_milssl.slide import open_slide

    with open_slide(slide) as s:
        return [int(v) for v in s.dimensions]


def _checkpoint(path: Path, *, target_mpp: float, patch_size_px: int, entropy_bits: float) -> Path:
    import torch

    from wsi_milssl.mil.checkpoint import save_checkpoint
    from wsi_milssl.mil.data import NORMALISATION
    from wsi_milssl.mil.models import create_model

    torch.manual_seed(0)
    model = create_model("resnet18")
    config = {"mode": "images", "model": "resnet18", "bag_pooling": "max", "target_mpp": target_mpp,
              "patch_size_px": patch_size_px, "entropy_threshold_bits": entropy_bits,
              "store_settings": {"target_mpp": target_mpp, "patch_size_px": patch_size_px, "stride_px": patch_size_px,
                                 "entropy_threshold_bits": entropy_bits},
              "normalisation": {k: list(v) for k, v in NORMALISATION.items()}, "model_name": "resnet18",
              "model_kwargs": {}}
    return save_checkpoint({"model": model.state_dict(), "optimizer": {}, "epoch": 0, "pseudo_labels": {}, "rng": {},
                            "config": config, "model_name": "resnet18", "model_kwargs": {}, "bag_pooling": "max"},
                           path)


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _tree_pss_kb(root: int) -> int:
    """Summed PSS (kB) of ``root`` and its descendants (shared pages split between their users)."""
    return sum(_pss_kb(pid) for pid in _tree_pids(root))


def _tree_rss_kb(root: int) -> int:
    """Summed VmRSS (kB) of ``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
            with open(f"/proc/{entry}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        rss[int(entry)] = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def run_command(slides: list[Path], ckpt: Path, out: Path, *, batch_size: int, workers: int, threads: int) -> dict:
    """Run ``wsi-milssl heatmap`` on ``slides`` in a child process; wall time, the slides' time (first
    slide opened to last file written), peak RSS and PSS, patches."""
    cmd = [sys.executable, "-m", "wsi_milssl", "heatmap", *map(str, slides), "--model", str(ckpt), "--out", str(out),
           "--batch-size", str(batch_size), "--workers", str(workers), "--threads", str(threads)]
    peak_tree = peak_pss = 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def sample() -> None:
        # RSS every 0.1 s (cheap); PSS every 2 s: reading smaps_rollup walks a process's page tables,
        # which on a 2-core machine takes CPU time from the command being measured
        nonlocal peak_tree, peak_pss
        k = 0
        while not stop.is_set():
            peak_tree = max(peak_tree, _tree_rss_kb(proc.pid))
            if k % 20 == 10:
                peak_pss = max(peak_pss, _tree_pss_kb(proc.pid))
            k += 1
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"heatmap command failed ({proc.returncode}):\n{output}")
    with open(out / "heatmap_status.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    found = re.search(r"patches in ([0-9.]+) s", output)
    if found is None:
        raise SystemExit(f"the heatmap command did not print its time:\n{output}")
    return {"wall_s": wall, "slide_s": float(found.group(1)), "n_patches": sum(int(r["n_patches"]) for r in rows),
            "n_slides": len(rows), "cpu_s": usage.ru_utime + usage.ru_stime,  # the command and its reaped readers
            "peak_rss_main_mb": usage.ru_maxrss / 1024, "peak_rss_tree_mb": peak_tree / 1024,
            "peak_pss_tree_mb": peak_pss / 1024}


def bare_forward(ckpt: Path, n: int, *, patch_size_px: int, batch_size: int, workers: int, threads: int,
                 fuse: bool = True, min_seconds: float = 2.0) -> dict:
    """Forward rate of the checkpoint's model on ready-made input tensors, with the command's runtime
    (``fuse=False``: the model as trained, without BatchNorm folded into the convolutions).

    CPU: ``n`` patches in the command's batches (the last one smaller), once. CUDA: full batches,
    synchronised only at the end, repeated for at least ``min_seconds``."""
    import torch

    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference import Preprocess, load_inference_model

    config = HeatmapConfig(batch_size=batch_size, num_workers=workers, threads=threads, fuse_batchnorm=fuse)
    model = load_inference_model(ckpt, config=config)
    dev = model.runtime.device
    rng = np.random.default_rng(0)
    u8 = torch.from_numpy(rng.integers(0, 256, (batch_size, patch_size_px, patch_size_px, 3), dtype=np.uint8))
    if dev.type == "cuda":
        x = u8.to(dev)  # the command hands the GPU uint8 pixels and normalises them there
    else:
        x = (model.worker_preprocess or Preprocess(model.tiling.mean, model.tiling.std))(u8)  # what readers make

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(3):  # warm-up: oneDNN primitives, cuDNN plans (one shape)
        model.probabilities(x)
    sync()
    if dev.type == "cuda":
        sizes, rounds = [batch_size], 0
    else:
        sizes = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    t0, c0 = time.perf_counter(), time.process_time()
    done = 0
    while True:
        for b in sizes:
            model.probabilities(x[:b])
            done += b
        if dev.type != "cuda":
            break
        rounds += 1
        if rounds % 20 == 0:
            sync()
            if time.perf_counter() - t0 >= min_seconds:
                break
    sync()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": dt, "cpu_s": cpu, "n": done, "patches_per_s": done / dt, "runtime": model.runtime.describe(),
            "torch_threads": torch.get_num_threads()}


def iou_report(ckpt: Path, slides_dir: Path, out: Path, *, threshold: float = 0.5) -> list[dict]:
    """Per tumour slide in ``slides_dir``: IoU of map cells >= threshold with cells >= 50 % tumour."""
    from wsi_milssl.annotations import read_annotations, tumor_fraction
    from wsi_milssl.config import HeatmapConfig
    from wsi_milssl.inference import make_heatmaps

    slides = sorted(p for p in slides_dir.glob("*.tif") if p.with_suffix(".xml").exists())
    if not slides:
        raise SystemExit(f"{slides_dir}: no slide with an XML annotation beside it.")
    make_heatmaps(slides, ckpt, out, HeatmapConfig(), annotations_dir=slides_dir)
    rows = []
    for slide in slides:
        grid = np.load(out / f"{slide.stem}_probs.npy")
        side = json.loads((out / f"{slide.stem}_probs.json").read_text())
        r, c = np.mgrid[: grid.shape[0], : grid.shape[1]]
        ox, oy = side["origin_lv0"]
        coords = np.stack([ox + c.ravel() * side["stride_lv0"], oy + r.ravel() * side["stride_lv0"]], axis=1)
        region = read_annotations(slide.with_suffix(".xml")).with_dimensions(tuple(side["dimensions_lv0"])).region
        truth = (tumor_fraction(region, coords, side["patch_size_lv0"]) >= 0.5).reshape(grid.shape)
        high = np.nan_to_num(grid, nan=0.0) >= threshold
        inter, union = int((high & truth).sum()), int((high | truth).sum())
        rows.append({"slide": slide.stem, "tumour_cells": int(truth.sum()), "high_cells": int(high.sum()),
                     "intersection": inter, "iou": inter / union if union else float("nan")})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("cpu", "gpu14"), default="cpu",
                   help="cpu: one --size slide; gpu14: 14 slides of 24,576 px in one command, batch 256")
    p.add_argument("--min-seconds", type=float, default=2.0, help="CUDA: time the bare forward at least this long")
    p.add_argument("--size", type=int, default=50000,
                   help="side of the throughput slide in px (0.25 µm/px; generated once, ~2.5 min for 50,000)")
    p.add_argument("--seed", type=int, default=1, help="synth seed of the generated slides")
    p.add_argument("--target-mpp", type=float, default=0.5, help="model resolution (µm/px)")
    p.add_argument("--patch-size", type=int, default=224, help="model patch size (px)")
    p.add_argument("--entropy-threshold", type=float, default=5.0, help="entropy filter (bits)")
    p.add_argument("--batch-size", type=int, default=None, help="[64; 256 with --preset gpu14; 0 = the commands' auto]")
    p.add_argument("--workers", type=int, default=-1, help="reader processes of the command (-1 auto)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--repeat", type=int, default=2, help="alternating command/bare runs; medians reported")
    p.add_argument("--slide", type=Path, default=None, help="use this slide for the throughput instead of generating")
    p.add_argument("--big", type=int, default=0, help="also run on a BIG x BIG px slide (memory check)")
    p.add_argument("--big-slide", type=Path, default=None,
                   help="an existing large slide for the memory check (e.g. one generated with --big before)")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "wsi_milssl_bench",
                   help="folder for generated slides (reused)")
    p.add_argument("--iou-checkpoint", type=Path, default=None, help="trained RUN_DIR/best.pt for the IoU table")
    p.add_argument("--iou-slides", type=Path, default=None, help="folder of generated slides + XML for the IoU")
    p.add_argument("--no-throughput", action="store_true", help="skip the throughput/memory runs (IoU only)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 256 if args.preset == "gpu14" else 64
    if args.batch_size == 0:  # the commands' auto, resolved as they resolve it (the bare forward needs a number)
        import torch

        from wsi_milssl.runtime import inference_batch_size

        args.batch_size = inference_batch_size(0, torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    args.cache.mkdir(parents=True, exist_ok=True)
    report: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench_heatmap_") as tmp:
        tmp = Path(tmp)
        if not args.no_throughput:
            ckpt = _checkpoint(tmp / "run" / "best.pt", target_mpp=args.target_mpp, patch_size_px=args.patch_size,
                               entropy_bits=args.entropy_threshold)
            if args.preset == "gpu14":
                slides, _ = build_slides(args.cache, n=14, size=24576)
            else:
                slides = [args.slide or _synth_slide(args.cache, args.size, seed=args.seed)]
            cmd_runs, bare_runs, trained_runs = [], [], []
            bare_kw = dict(patch_size_px=args.patch_size, batch_size=args.batch_size, workers=args.workers,
                           threads=args.threads, min_seconds=args.min_seconds)
            for i in range(args.repeat):
                cmd_runs.append(run_command(slides, ckpt, tmp / f"hm{i}", batch_size=args.batch_size,
                                            workers=args.workers, threads=args.threads))
                n = cmd_runs[-1]["n_patches"]
                bare_runs.append(bare_forward(ckpt, n, **bare_kw))
                trained_runs.append(bare_forward(ckpt, n, fuse=False, **bare_kw))
                c, b, t = cmd_runs[-1], bare_runs[-1], trained_runs[-1]
                print(f"run {i + 1}: command {n / c['wall_s']:.1f} patches/s (slides {n / c['slide_s']:.1f}), "
                      f"bare forward {b['patches_per_s']:.1f} (as trained {t['patches_per_s']:.1f}) patches/s",
                      flush=True)
            n = cmd_runs[0]["n_patches"]
            cmd_rate = statistics.median(n / r["wall_s"] for r in cmd_runs)
            slide_rate = statistics.median(n / r["slide_s"] for r in cmd_runs)
            bare_rate = statistics.median(b["patches_per_s"] for b in bare_runs)
            trained_rate = statistics.median(b["patches_per_s"] for b in trained_runs)
            dims = _dims(slides[0])
            report["throughput"] = {"slides": [str(x) for x in slides], "dimensions_lv0": dims, "n_patches": n,
                                    "command_patches_per_s": cmd_rate,
                                    "slide_patches_per_s": slide_rate, "bare_forward_patches_per_s": bare_rate,
                                    "bare_forward_as_trained_patches_per_s": trained_rate,
                                    "ratio_command": cmd_rate / bare_rate, "ratio_slide": slide_rate / bare_rate,
                                    "ratio_command_as_trained": cmd_rate / trained_rate,
                                    "ratio_slide_as_trained": slide_rate / trained_rate,
                                    "runtime": bare_runs[0]["runtime"], "torch_threads": bare_runs[0]["torch_threads"],
                                    "runs": cmd_runs, "bare_runs": bare_runs, "bare_as_trained_runs": trained_runs}
            print()
            if torch_gpu := _gpu_name():
                report["gpu"] = torch_gpu
            print(f"{len(slides)} slide(s) of {dims[0]} x {dims[1]} px, {n} patches of {args.patch_size} px at "
                  f"{args.target_mpp} µm/px, {'GPU ' + torch_gpu + ', ' if torch_gpu else ''}"
                  f"batch {args.batch_size}, {bare_runs[0]['runtime']}, torch threads {bare_runs[0]['torch_threads']}; "
                  f"medians of {args.repeat} runs\n")
            print("| measure | patches/s | x bare forward (BN folded, what the command runs) | x bare forward (as trained) |")
            print("|---|---:|---:|---:|")
            print(f"| bare forward, BatchNorm folded | {bare_rate:.1f} | 1.00 | {bare_rate / trained_rate:.2f} |")
            print(f"| bare forward, model as trained | {trained_rate:.1f} | {trained_rate / bare_rate:.2f} | 1.00 |")
            for label, rate in (("heatmap command, whole (wall)", cmd_rate),
                                ("heatmap command, first slide opened to last file written", slide_rate)):
                print(f"| {label} | {rate:.1f} | {rate / bare_rate:.2f} | {rate / trained_rate:.2f} |")
            cpu_cmd = statistics.median(r["cpu_s"] for r in cmd_runs) / n
            cpu_bare = statistics.median(b["cpu_s"] for b in bare_runs) / n
            report["throughput"].update(cpu_ms_per_patch_command=1e3 * cpu_cmd, cpu_ms_per_patch_bare=1e3 * cpu_bare)
            print(f"\nCPU time per patch (all threads and workers; insensitive to other load): command "
                  f"{1e3 * cpu_cmd:.1f} ms, bare forward {1e3 * cpu_bare:.1f} ms (ratio {cpu_bare / cpu_cmd:.2f})")
            mem = [(dims, cmd_runs[0])]
            if args.big or args.big_slide:
                big = args.big_slide or _synth_slide(args.cache, args.big, seed=args.seed)
                r = run_command([big], ckpt, tmp / "hm_big", batch_size=args.batch_size, workers=args.workers,
                                threads=args.threads)
                big_dims = _dims(big)
                bare = bare_forward(ckpt, r["n_patches"], patch_size_px=args.patch_size, batch_size=args.batch_size,
                                    workers=args.workers, threads=args.threads)
                report["big"] = {"slide": str(big), "dimensions_lv0": big_dims, **r, "bare_forward": bare}
                mem.append((big_dims, r))
                n_big = r["n_patches"]
                print(f"\n| {big_dims[0]} x {big_dims[1]} px slide, {n_big} patches | patches/s | x bare forward |")
                print("|---|---:|---:|")
                print(f"| bare model forward (same tensors) | {bare['patches_per_s']:.1f} | 1.00 |")
                for label, secs in (("heatmap command, whole (wall)", r["wall_s"]),
                                    ("heatmap command, slide time", r["slide_s"])):
                    rate = n_big / secs
                    print(f"| {label} | {rate:.1f} | {rate / bare['patches_per_s']:.2f} |")
                print(f"CPU time per patch: command {1e3 * r['cpu_s'] / n_big:.1f} ms, bare forward "
                      f"{1e3 * bare['cpu_s'] / n_big:.1f} ms (ratio {bare['cpu_s'] / r['cpu_s']:.2f})")
            print()
            print("| slides | patches | peak RSS main (MB) | peak RSS process tree (MB) | peak PSS process tree (MB) |")
            print("|---|---:|---:|---:|---:|")
            for (w, h), r in mem:
                print(f"| {r['n_slides']} x {w} x {h} px | {r['n_patches']} | {r['peak_rss_main_mb']:.0f} | "
                      f"{r['peak_rss_tree_mb']:.0f} | {r['peak_pss_tree_mb']:.0f} |")
        if args.iou_checkpoint is not None:
            if args.iou_slides is None:
                raise SystemExit("--iou-checkpoint needs --iou-slides")
            rows = iou_report(args.iou_checkpoint, args.iou_slides, tmp / "hm_iou")
            report["iou"] = rows
            print("\n| slide | tumour cells | cells p >= 0.5 | intersection | IoU |")
            print("|---|---:|---:|---:|---:|")
            for row in rows:
                print(f"| {row['slide']} | {row['tumour_cells']} | {row['high_cells']} | {row['intersection']} | "
                      f"{row['iou']:.3f} |")
            inter = sum(r["intersection"] for r in rows)
            union = sum(r["tumour_cells"] + r["high_cells"] - r["intersection"] for r in rows)
            print(f"| all | | | | {inter / union if union else float('nan'):.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
