"""Shared fixtures: tiny generated slides read through OpenSlide (made once per test session)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from wsi_milssl.config import SynthConfig
from milcsv import make_mil_csv
from wsi_milssl.synth import generate_slides


@pytest.fixture(autouse=True)
def _root_logger_level_restored():
    """Every test starts with the root logger's level the session started with: ``main([... "-q"])`` in
    a test sets it to ERROR (WARNING without -q) for the process, which hid the warnings later tests of
    the same process look for (an order-dependent failure)."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _cli_log_handlers_removed():
    """Every test starts without the log handlers an earlier ``main()`` of the same process attached (to the root
    logger, and the progress lines'): they write to the stderr of the test that called it, which pytest has closed
    since, so a later test's warning printed "--- Logging error ---" into its own captured stderr (review EJ)."""
    yield
    from wsi_milssl import cli
    from wsi_milssl.cli.progress import LINE_LOGGER

    root = logging.getLogger()
    for handler in cli._OUR_HANDLERS:
        root.removeHandler(handler)
        handler.close()
    cli._OUR_HANDLERS.clear()
    for handler in list(LINE_LOGGER.handlers):
        LINE_LOGGER.removeHandler(handler)


#: most pytest-xdist workers ``-n auto`` starts: each builds its own session fixtures and holds its own models
MAX_AUTO_WORKERS = 8


def _cores() -> int:
    """The CPU cores this process may run on (``taskset``, a container's cpuset), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject addopts): one worker per CPU core and one more, at most :data:`MAX_AUTO_WORKERS`.
    Many tests spend their time waiting on the processes they start (pipeline runs, torchrun ranks, killed
    runs whose ends are awaited), so a worker per core leaves cores idle: on 2 cores, 3 workers ran the suite
    in 580-620 s against 659-674 s for 2 (quiet machine, 2026-11-28)."""
    return max(1, min(_cores() + 1, MAX_AUTO_WORKERS))


def _threads_per_worker() -> None:
    """Under pytest-xdist (``-n N``) every worker process gets an equal share of the CPU cores for torch, so N
    workers do not each start one thread per core and fight over them. The processes a test starts (pipeline
    runs, CLI commands, torchrun ranks) get the same share through ``OMP_NUM_THREADS``: with torch's default of
    one thread per core, a child beside a busy worker spent most of its time waiting on its own threads (a
    2-thread image fit beside another busy process took 27 s on 2 cores, 13 s with 1 thread)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, _cores() // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


_threads_per_worker()

#: torch's CPU thread count when the session started
_TORCH_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with torch's thread count the session started with: ``fit``, the heatmap and features
    models and the benchmarks call ``torch.set_num_threads`` (``threads = 1`` in many tests) and leave it, so a
    later test of the same process trained with another count, whose float sums differ in their last bits (an
    order-dependent result: the same seeded fit gave loss 0.4149 after 2 threads, 0.4244 after 1)."""
    yield
    if torch.get_num_threads() != _TORCH_THREADS:
        torch.set_num_threads(_TORCH_THREADS)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    """Two 4096 x 4096 px slides at 0.25 µm/px: synth_000 and synth_001, one tumour and one normal,
    with ``labels.csv``, ``manifest.json`` and an ASAP XML file beside the tumour slide."""
    out = tmp_path_factory.mktemp("synth")
    generate_slides(SynthConfig(n_slides=2, seed=0, width_px=4096, height_px=4096), out)
    return out


@pytest.fixture(scope="session")
def synth_slides(synth_dir) -> dict[str, Path]:
    """Map 'tumor' and 'normal' to the slide path of each kind in ``synth_dir``."""
    import csv

    with open(synth_dir / "labels.csv") as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for row in rows:
        out["tumor" if row["label"] == "1" else "normal"] = synth_dir / f"{row['slide']}.tif"
    return out


@pytest.fixture(scope="session")
def four_slides(synth_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(folder of slides slide_0..slide_3, annotation folder): hard links to (or copies of) synth_000
    and synth_001 in turn, with the tumour slides' ASAP XML as slide_0.xml and slide_2.xml."""
    import os
    import shutil

    root = tmp_path_factory.mktemp("four")
    slides, annotations = root / "slides", root / "annotations"
    slides.mkdir()
    annotations.mkdir()
    for k in range(4):
        source = synth_dir / f"synth_00{k % 2}.tif"
        try:
            os.link(source, slides / f"slide_{k}.tif")
        except OSError:
            shutil.copy(source, slides / f"slide_{k}.tif")
    for k in (0, 2):
        shutil.copy(synth_dir / "synth_000.xml", annotations / f"slide_{k}.xml")
    return slides, annotations


@pytest.fixture(scope="session")
def mil_csv(tmp_path_factory) -> Path:
    """40 bags (20 positive), 8 features, informative instance labels."""
    return make_mil_csv(tmp_path_factory.mktemp("milcsv") / "toy.csv")


@pytest.fixture(scope="session")
def mil_csv_val(tmp_path_factory) -> Path:
    """An independent draw of the same problem, for validation."""
    return make_mil_csv(tmp_path_factory.mktemp("milcsv_val") / "toy_val.csv", seed=1)
