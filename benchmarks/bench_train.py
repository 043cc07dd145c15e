"""Training throughput: the product's training and refresh passes beside the bare model step, same run.

    python benchmarks/bench_train.py                        # CPU defaults: 4 slides of 8,192 px, 224 px patches
    python benchmarks/bench_train.py --preset gpu14         # the GPU set: 14 slides of 24,576 px, 224 and 512 px
    python benchmarks/bench_train.py --json out.json --workers 8 --decode device

1. Data. Slides are generated with ``wsi-milssl synth --slides 1 --seed K`` (one process per slide, in
   parallel; even seeds tumour, odd seeds normal), linked under unique names and tiled with the tile
   stage at ``--mpp`` µm/px into ``--patch-size`` px JPEG patch stores (HDF5). Everything is cached in
   ``--cache``.
2. Bare rates, measured in this process with the runtime the training resolves (device, autocast
   dtype, channels_last, threads): the train step of the same model (ResNet18, SGD with the config's
   momentum and weight decay, soft cross-entropy) on a ready-made normalised batch already on the
   device, and the inference forward at the evaluation batch size. Both are measured before and after
   the training run and averaged, because a shared machine drifts.
3. The product: ``wsi_milssl.mil.fit`` for ``--epochs`` epochs on the stores (augmentation on, the
   run's readers, the pseudo-label refresh every epoch). The last epoch is reported: its training
   pass (patches per second, reading, decoding, augmentation and the step, refresh excluded) and its
   refresh pass (positive-bag patches per second).

4. With ``--ddp N``: the ``wsi-milssl train`` command itself, once as one plain process and once under
   ``torchrun --nproc-per-node N`` (DistributedDataParallel; NCCL on GPUs, gloo on CPUs), on the
   same stores and settings; the last epoch's training-pass rate of each (all ranks together) and
   their ratio. ``--ddp 1`` is the cost of the distributed machinery on one GPU.

5. With ``--profile DIR``: a separate one-epoch run with 20 training steps under ``torch.profiler``
   (operators of the main process by CPU and device time, a Perfetto trace, and the fraction of the
   window the GPU was busy): where the training pass loses against the bare step.

Prints a table per patch size; ``--json PATH`` writes the numbers, with ``train_pass_ratio`` and
``refresh_ratio`` (of the first patch size) at the top level.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _slides import build_slides  # benchmarks/_slides.py

PRESETS = {
    "cpu": {"slides": 4, "size": 8192, "patch_sizes": [224], "epochs": 2},
    "gpu14": {"slides": 14, "size": 24576, "patch_sizes": [224, 512], "epochs": 3},
}


def build_stores(slides: list[Path], out: Path, *, mpp: float, patch_size: int, workers: int) -> list[Path]:
    from wsi_milssl.config import TileConfig
    from wsi_milssl.tiling import tile_slides

    t0 = time.perf_counter()
    run = tile_slides(slides, out, TileConfig(target_mpp=mpp, patch_size_px=patch_size, workers=workers))
    if not run.ok:
        raise SystemExit(f"tiling failed: see {run.status_csv}")
    n = sum(r.n_patches for r in run.results)
    print(f"stores: {n} patches of {patch_size} px in {time.perf_counter() - t0:.1f} s ({out})", flush=True)
    return [Path(r.store_path) for r in run.results]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_rates(config, *, patch_size: int, min_seconds: float, eval_batch: int) -> dict:
    """Bare train step (``config.batch_size``) and inference forward (``eval_batch``) rates, images/s."""
    import numpy as np
    import torch

    from wsi_milssl.mil.models import create_model
    from wsi_milssl.mil.pixels import prepare_patches
    from wsi_milssl.mil.selftrain import _compiled, make_optimizer, resolve_runtime, soft_cross_entropy

    runtime = resolve_runtime(config)
    dev = runtime.device
    torch.manual_seed(0)
    model = create_model(config.model, num_classes=2).to(dev)
    if runtime.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(model, config)
    rng = np.random.default_rng(0)

    def batch(b: int) -> torch.Tensor:
        u8 = torch.from_numpy(rng.integers(0, 256, (b, patch_size, patch_size, 3), dtype=np.uint8))
        return prepare_patches(u8.to(dev))

    def timed(fn, n_warm: int = 3) -> float:
        for _ in range(n_warm):
            fn()
        _sync(dev)
        steps, t0 = 0, time.perf_counter()
        while True:
            fn()
            steps += 1
            if steps >= 3 and time.perf_counter() - t0 >= min_seconds:
                break
        _sync(dev)
        return steps / (time.perf_counter() - t0)

    x, y = batch(config.batch_size), torch.rand(config.batch_size, device=dev)
    model.train()
    trainer = model if config.compile == "off" else _compiled(model, config.compile)  # as fit() compiles

    def step() -> None:
        if config.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with runtime.autocast():
            logits = trainer(x)
        loss = soft_cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train_rate = timed(step) * config.batch_size
    xe = batch(eval_batch)
    model.eval()

    def forward() -> None:
        with torch.inference_mode(), runtime.autocast():
            torch.softmax(model(xe).float(), 1)

    infer_rate = timed(forward, n_warm=2) * eval_batch
    return {"train_step": train_rate, "inference": infer_rate, "runtime": runtime.describe()}


def count_positive_bag_patches(stores: list[Path], labels: Path) -> int:
    from wsi_milssl.mil import read_labels_csv, read_patch_stores

    inst = read_patch_stores(stores, read_labels_csv(labels))
    return int((inst.instance_bag_labels == 1).sum())


def product_rates(stores: list[Path], labels: Path, config) -> dict:
    """The last epoch of ``fit``: training-pass and refresh-pass patches/s."""
    from wsi_milssl.mil import fit, read_labels_csv, read_patch_stores

    inst = read_patch_stores(stores, read_labels_csv(labels))
    n_pos = int((inst.instance_bag_labels == 1).sum())
    t0 = time.perf_counter()
    result = fit(inst, config=config)
    wall = time.perf_counter() - t0
    last = result.history[-1]
    return {"instances": len(inst), "positive_bag_instances": n_pos, "epochs": config.epochs, "fit_s": wall,
            "train_pass": last["instances_per_second"], "refresh": n_pos / max(last["refresh_seconds"], 1e-9),
            "epoch_s": [round(h["train_seconds"], 2) for h in result.history],
            "refresh_s": [round(h["refresh_seconds"], 2) for h in result.history]}


def profile_steps(stores: list[Path], labels: Path, config, out_dir: Path, *, tag: str, skip: int = 20,
                  active: int = 20) -> dict:
    """A one-epoch ``fit`` under ``torch.profiler``: ``active`` training steps after ``skip`` (+3 warm-up).

    Writes ``out_dir/<tag>_ops.txt`` (the main process's operators by self CPU time and by device
    time) and ``out_dir/<tag>_trace.json.gz`` (a Chrome/Perfetto trace of the window). Returns the
    window's wall time per step, the device (kernel) time per step and their ratio, the fraction of
    the window the GPU was busy (CUDA only). The profiled run is not one of the timed ones.
    """
    import dataclasses
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from wsi_milssl.mil import fit, read_labels_csv, read_patch_stores

    inst = read_patch_stores(stores, read_labels_csv(labels))
    cuda = torch.cuda.is_available() and config.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    stamps: list[float] = []
    report: dict = {}

    def ready(prof) -> None:
        events = prof.key_averages()
        dev_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        device_us = sum(getattr(e, dev_attr, 0.0) for e in events)
        cpu_us = sum(e.self_cpu_time_total for e in events)
        lines = [f"{tag}: {active} training steps of {config.batch_size} after {skip} + 3 warm-up", "",
                 "by self CPU time (main process):",
                 events.table(sort_by="self_cpu_time_total", row_limit=40)]
        if cuda:
            lines += ["", "by device time:", events.table(sort_by=dev_attr, row_limit=25)]
        (out_dir / f"{tag}_ops.txt").write_text("\n".join(lines) + "\n")
        trace = out_dir / f"{tag}_trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        steps = max(1, min(active, len(stamps) - (skip + 3)))  # fewer when the epoch ends first
        report.update(steps=steps, device_ms_per_step=device_us / 1e3 / steps, cpu_op_ms_per_step=cpu_us / 1e3 / steps)

    def on_event(event) -> None:
        if event.stage == "train-epoch":
            stamps.append(time.perf_counter())
            prof.step()

    cfg = dataclasses.replace(config, epochs=1)
    with profile(activities=activities, schedule=schedule(wait=skip, warmup=3, active=active, repeat=1),
                 on_trace_ready=ready) as prof:
        fit(inst, config=cfg, progress=on_event)
    first = skip + 3  # stamps[i] is the end of step i + 1
    steps = report.get("steps", 0)
    if steps and len(stamps) >= first + steps:
        wall_ms = (stamps[first + steps - 1] - stamps[first - 1]) * 1e3 / steps
        report["wall_ms_per_step"] = wall_ms
        if "device_ms_per_step" in report and cuda:
            report["gpu_busy_fraction"] = report["device_ms_per_step"] / wall_ms
    report["files"] = [f"{tag}_ops.txt", f"{tag}_trace.json.gz"]
    return report


def command_rate(stores: list[Path], labels: Path, config, *, nproc: int) -> dict:
    """The last epoch's training-pass rate of ``wsi-milssl train`` (a plain process with ``nproc`` 0,
    else under torchrun with ``nproc`` processes)."""
    args = ["train", *map(str, stores), "--labels", str(labels), "--epochs", str(config.epochs),
            "--batch-size", str(config.batch_size), "--eval-batch-size", str(config.eval_batch_size),
            "--workers", str(config.num_workers), "--device", config.device, "--threads", str(config.threads),
            "--mu-ramp-epochs", "1", "--no-plots", "--shuffle-block", str(config.shuffle_block),
            "--decode", config.decode]
    with tempfile.TemporaryDirectory(prefix="bench_train_cmd_") as tmp:
        out = Path(tmp) / "run"
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                     "-m", "wsi_milssl"] if nproc else [sys.executable, "-m", "wsi_milssl"])
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        t0 = time.perf_counter()
        done = subprocess.run([*launcher, *args, "--out", str(out)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"train command failed:\n{done.stdout}\n{done.stderr}")
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"nproc": nproc, "train_pass": history[-1]["instances_per_second"], "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--slides", type=int, default=None, help="generated slides (preset)")
    p.add_argument("--size", type=int, default=None, help="slide side in level-0 px at 0.25 µm/px (preset)")
    p.add_argument("--patch-size", type=int, nargs="+", default=None, help="patch sizes in px (preset)")
    p.add_argument("--mpp", type=float, default=0.5, help="tiling resolution, µm/px [0.5]")
    p.add_argument("--epochs", type=int, default=None, help="epochs; the last one is reported (preset)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-batch-size", type=int, default=512)
    p.add_argument("--workers", type=int, default=-1, help="training readers (-1 = the product's auto)")
    p.add_argument("--decode", choices=("workers", "device"), default="workers")
    p.add_argument("--compile", default="off", metavar="MODE",
                   help="torch.compile mode of the training step (TrainConfig.compile), in the bare step too [off]")
    p.add_argument("--shuffle-block", type=int, default=None, help="[TrainConfig default]")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--min-seconds", type=float, default=None, help="time per bare measurement [5 CPU, 3 GPU]")
    p.add_argument("--tile-workers", type=int, default=None, help="[CPUs]")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "wsi_milssl_bench_train")
    p.add_argument("--ddp", type=int, default=0, metavar="N",
                   help="also compare the train command under torchrun with N processes to one plain process")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="also profile 20 training steps of a one-epoch run per patch size (torch.profiler) into DIR")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from wsi_milssl.config.train import TrainConfig

    preset = PRESETS[args.preset]
    n_slides = args.slides or preset["slides"]
    size = args.size or preset["size"]
    patch_sizes = args.patch_size or preset["patch_sizes"]
    epochs = args.epochs or preset["epochs"]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    slides, labels = build_slides(args.cache, n=n_slides, size=size)
    report: dict = {"preset": args.preset, "slides": n_slides, "size_px": size, "mpp": args.mpp, "results": []}
    if torch.cuda.is_available() and args.device != "cpu":
        report["gpu"] = torch.cuda.get_device_name(0)
    report["cpus"] = os.cpu_count()
    for patch in patch_sizes:
        stores = build_stores(slides, args.cache / f"stores_{size}_{args.mpp:g}_{patch}", mpp=args.mpp,
                              patch_size=patch, workers=args.tile_workers or (os.cpu_count() or 1))
        extra = {} if args.shuffle_block is None else {"shuffle_block": args.shuffle_block}
        config = TrainConfig(mode="images", epochs=epochs, batch_size=args.batch_size,
                             eval_batch_size=args.eval_batch_size, num_workers=args.workers, decode=args.decode,
                             device=args.device, threads=args.threads, plots=False, mu_ramp_epochs=1,
                             compile=args.compile, **extra)
        dev_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        min_s = args.min_seconds or (3.0 if dev_cuda else 5.0)
        # the refresh pass runs batches of eval_batch_size (one smaller batch when fewer patches)
        n_pos = count_positive_bag_patches(stores, labels)
        eval_batch = min(args.eval_batch_size, n_pos)
        before = bare_rates(config, patch_size=patch, min_seconds=min_s, eval_batch=eval_batch)
        product = product_rates(stores, labels, config)
        after = bare_rates(config, patch_size=patch, min_seconds=min_s, eval_batch=eval_batch)
        step = statistics.mean([before["train_step"], after["train_step"]])
        infer = statistics.mean([before["inference"], after["inference"]])
        row = {"patch_size_px": patch, "runtime": before["runtime"], "eval_batch": eval_batch, **product,
               "bare_train_step": step, "bare_train_step_runs": [before["train_step"], after["train_step"]],
               "bare_inference": infer, "bare_inference_runs": [before["inference"], after["inference"]],
               "train_pass_ratio": product["train_pass"] / step, "refresh_ratio": product["refresh"] / infer}
        report["results"].append(row)
        print(f"\n{patch} px patches, {product['instances']} instances ({product['positive_bag_instances']} in "
              f"positive bags), batch {args.batch_size}, eval batch {eval_batch}; {before['runtime']}")
        print(f"{'measure':<38}{'patches/s':>12}{'ratio':>8}")
        print(f"{'bare train step (before, after)':<38}{step:>12.1f}{'1.00':>8}   "
              f"({before['train_step']:.1f}, {after['train_step']:.1f})")
        print(f"{'training pass (last epoch)':<38}{product['train_pass']:>12.1f}{row['train_pass_ratio']:>8.2f}")
        print(f"{'bare inference (before, after)':<38}{infer:>12.1f}{'1.00':>8}   "
              f"({before['inference']:.1f}, {after['inference']:.1f})")
        print(f"{'refresh pass (last epoch)':<38}{product['refresh']:>12.1f}{row['refresh_ratio']:>8.2f}")
        print(f"epoch seconds {product['epoch_s']}, refresh seconds {product['refresh_s']}", flush=True)
        if args.profile:
            row["profile"] = profile_steps(stores, labels, config, args.profile, tag=f"train_{patch}px")
            prof = row["profile"]
            print("profiled window: " + ", ".join(f"{k} {v:.3f}" for k, v in prof.items() if isinstance(v, float))
                  + f" ({args.profile})", flush=True)
        if args.ddp:
            plain = command_rate(stores, labels, config, nproc=0)
            ddp = command_rate(stores, labels, config, nproc=args.ddp)
            row["ddp"] = {"plain": plain, "torchrun": ddp, "ratio": ddp["train_pass"] / plain["train_pass"]}
            print(f"{'train command, one process':<38}{plain['train_pass']:>12.1f}{'1.00':>8}")
            print(f"{f'train command, torchrun x {args.ddp}':<38}{ddp['train_pass']:>12.1f}"
                  f"{row['ddp']['ratio']:>8.2f}", flush=True)
    report["train_pass_ratio"] = report["results"][0]["train_pass_ratio"]
    report["refresh_ratio"] = report["results"][0]["refresh_ratio"]
    report["total_s"] = time.perf_counter() - t_start
    print(f"\nwhole benchmark: {report['total_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
