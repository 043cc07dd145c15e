"""Generated slide sets shared by the benchmarks (cached between runs)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["build_slides"]


def build_slides(cache: Path, *, n: int, size: int) -> tuple[list[Path], Path]:
    """``n`` slides ``slide_KK.tif`` of ``size`` x ``size`` px at 0.25 µm/px and their labels.csv.

    One ``wsi-milssl synth --slides 1 --seed K`` process per slide, as many at once as there are CPUs;
    even seeds carry tumour, odd seeds are normal. Slides are linked under unique names (every synth
    folder names its slide synth_000) in ``cache/slides_<size>/linked``.
    """
    root = cache / f"slides_{size}"
    linked = root / "linked"
    linked.mkdir(parents=True, exist_ok=True)

    def one(seed: int) -> tuple[Path, int]:
        folder = root / f"seed{seed:02d}"
        if not (folder / "labels.csv").exists():
            subprocess.run([sys.executable, "-m", "wsi_milssl", "synth", str(folder), "--slides", "1",
                            "--seed", str(seed), "--size-px", str(size), str(size),
                            "--tumor-slide-fraction", "1" if seed % 2 == 0 else "0"],
                           check=True, stdout=subprocess.DEVNULL)
        with open(folder / "labels.csv", newline="") as fh:
            label = int(next(csv.DictReader(fh))["label"])
        link = linked / f"slide_{seed:02d}.tif"
        if not link.exists():
            link.symlink_to((folder / "synth_000.tif").resolve())
        return link, label

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1))) as pool:
        made = list(pool.map(one, range(n)))
    labels = linked / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"{p.stem},{y}\n" for p, y in made))
    print(f"slides: {n} x {size} px ready in {time.perf_counter() - t0:.1f} s ({root})", flush=True)
    return [p for p, _ in made], labels
