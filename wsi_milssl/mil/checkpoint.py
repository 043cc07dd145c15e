"""Training checkpoints: atomic save, safe load (``weights_only=True``), RNG capture, and ``load_model``.

A checkpoint is one dict (this docstring is its description; ``docs/artifacts.md`` describes the
``tiling_plan`` its config carries): ``model`` (state dict), ``optimizer``,
``scheduler``, ``grad_scaler``, ``epoch`` (completed epochs), ``step`` (optimizer steps), ``pseudo_labels``
(targets of every training instance and the bookkeeping of the pseudo-label refresh), ``rng`` (torch,
CUDA, numpy and Python generator states), ``config`` (the resolved training config plus the tiling settings
of the training stores and the input normalisation), ``model_name``, ``model_kwargs``, ``bag_pooling``,
``best`` and ``metrics``. Only plain containers, numbers, strings and tensors are stored, so
``torch.load(path, weights_only=True)`` reads it.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from wsi_milssl.atomic import atomic_open
from wsi_milssl.errors import CheckpointError
from wsi_milssl.weights import load_torch_file

__all__ = ["save_checkpoint", "interrupt_after", "read_checkpoint", "load_model", "capture_rng", "restore_rng",
           "resolve_checkpoint_path", "check_resume_parts", "CHECKPOINT_FORMAT", "INCOMPLETE_FIX",
           "READ_FIX", "RESUME_FIX"]

CHECKPOINT_FORMAT = "wsi-milssl-train-checkpoint/1"


def capture_rng() -> dict[str, Any]:
    """The states of torch (CPU and CUDA), numpy's global and Python's ``random`` generators."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "numpy": {"name": str(np_state[0]), "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": int(py_state[0]), "state": list(py_state[1]),
                   "gauss": None if py_state[2] is None else float(py_state[2])},
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``checkpoint`` atomically: temporary file in the same folder, fsync, rename. A Ctrl-C during the save
    takes effect once the file is in place (:func:`interrupt_after`)."""
    path = Path(path)
    with interrupt_after(), atomic_open(path, "wb") as fh:
        torch.save({"format": CHECKPOINT_FORMAT, **checkpoint}, fh)
    return path


@contextmanager
def interrupt_after() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside the block takes effect when the block ends (a second one at once): torch.save turns a
    KeyboardInterrupt raised inside its writer into a RuntimeError ("enforce fail at inline_container.cc"), which
    ended an interrupted training run with a traceback instead of "interrupted". Outside the main thread, where
    signal handlers cannot be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def later(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        if callable(previous):
            previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """A checkpoint file, or a run folder: its ``best.pt`` when present, else ``last.pt``."""
    path = Path(path)
    if path.is_dir():
        for name in ("best.pt", "last.pt"):
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"{path}: run folder holds neither best.pt nor last.pt; train first "
                              "(`wsi-milssl train ... --out RUN_DIR`) or pass a checkpoint file.")
    if not path.is_file():
        if path.name == "best.pt" and (path.parent / "last.pt").is_file():  # (review EW: the fix was the path given)
            raise CheckpointError(f"{path}: not written by this run (best.pt is the epoch that validation chose: "
                                  "`train --val`); its last epoch is last.pt. Fix: pass the run folder "
                                  f"{path.parent} (it takes last.pt then), or train with --val.")
        raise CheckpointError(f"{path}: checkpoint not found; pass RUN_DIR/best.pt, RUN_DIR/last.pt or RUN_DIR.")
    return path


def read_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                    fix: str | None = None) -> dict[str, Any]:
    """Load a training checkpoint with ``weights_only=True`` and check its format. A file that cannot be
    loaded so (damaged, TorchScript, pickled objects, no PyTorch file) raises one CheckpointError line
    saying what it is (:func:`wsi_milssl.weights.load_torch_file`), ending in ``fix`` (default:
    :data:`READ_FIX`, which serves ``heatmap --model`` and a resume alike)."""
    path = resolve_checkpoint_path(path)
    ckpt = load_torch_file(path, fix=fix or READ_FIX, map_location=map_location, verify=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a wsi-milssl training checkpoint (format "
                              f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt).__name__!r}); "
                              "pass RUN_DIR/best.pt or RUN_DIR/last.pt.")
    return ckpt


def load_model(checkpoint_path: str | os.PathLike, *, device: str | torch.device = "cpu"
               ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild the trained model from a checkpoint (or a run folder) for inference.

    Returns ``(model, config)``: the model in eval mode on ``device``, and the checkpoint's config dict
    (resolved TrainConfig fields plus ``target_mpp``, ``patch_size_px``, ``entropy_threshold_bits``,
    ``normalisation``, ``model_name``, ``model_kwargs`` and ``bag_pooling``). Image inputs must be
    prepared with :func:`wsi_milssl.mil.data.to_tensor`.
    """
    from wsi_milssl.errors import ConfigError
    from wsi_milssl.mil.models import create_model

    path = resolve_checkpoint_path(checkpoint_path)
    ckpt = read_checkpoint(path)
    _check_model_parts(ckpt, path)
    kwargs = dict(ckpt.get("model_kwargs") or {})
    try:
        model = create_model(ckpt["model_name"], **kwargs)
    except (ConfigError, TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: torch refusing a size
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(f"{path}: cannot build model {ckpt['model_name']!r} with the saved model_kwargs "
                              f"{kwargs!r} ({first}). {INCOMPLETE_FIX}") from None
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: weights do not fit model {ckpt['model_name']!r} ({exc}).") from None
    model.to(device).eval()
    config = dict(ckpt.get("config") or {})
    config.setdefault("model_name", ckpt["model_name"])
    config.setdefault("model_kwargs", kwargs)
    config.setdefault("bag_pooling", ckpt.get("bag_pooling", "max"))
    return model, config


INCOMPLETE_FIX = ("The checkpoint is incomplete or was not written by this version's `wsi-milssl train`. "
                   "Fix: re-run training, or pass RUN_DIR/best.pt or RUN_DIR/last.pt of a complete run.")

#: The fix for a checkpoint file that cannot be loaded: it serves both ``heatmap --model`` and a resume.
READ_FIX = ("Fix: pass RUN_DIR/best.pt or RUN_DIR/last.pt of a complete `wsi-milssl train` run (to resume a run: "
            "put its complete last.pt back, or train again without --resume into a new --out).")

#: The fix a resume gives for a ``last.pt`` it cannot continue from (another checkpoint would not continue this run).
RESUME_FIX = ("The checkpoint is incomplete or was not written by this version's `wsi-milssl train`, so the run "
              "cannot be resumed from it. Fix: put the run's complete last.pt back, or train again without --resume "
              "into a new --out (in `wsi-milssl run`: --force train).")


def _check_model_parts(ckpt: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError unless ``ckpt`` holds what :func:`load_model` needs, of the right types."""
    problems = _model_part_problems(ckpt)
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}. {INCOMPLETE_FIX}")


def _model_part_problems(ckpt: dict[str, Any]) -> list[str]:
    """What is missing or mistyped among the parts :func:`load_model` reads."""
    problems = []
    name = ckpt.get("model_name")
    if not isinstance(name, str) or not name:
        problems.append("'model_name' is missing" if name is None else f"'model_name' is {name!r}, not a model name")
    state = ckpt.get("model")
    if state is None:
        problems.append("'model' (the weights) is missing")
    elif not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in state.items()):
        problems.append(f"'model' is a {type(state).__name__}, not a state dict of tensors")
    for key in ("model_kwargs", "config"):
        value = ckpt.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key!r} is a {type(value).__name__}, not a dict")
    pooling = ckpt.get("bag_pooling")
    if pooling is not None and not isinstance(pooling, str):
        problems.append(f"'bag_pooling' is {pooling!r}, not a name")
    return problems


#: What ``train --resume`` restores from ``last.pt`` besides the model, and the type each must have.
_RESUME_PARTS = {"optimizer": dict, "pseudo_labels": dict, "rng": dict, "epoch": int, "step": int}


def check_resume_parts(ckpt: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError, naming every missing or mistyped part, unless ``ckpt`` holds what a resume
    needs: the model parts (:func:`load_model`'s) and the optimizer, pseudo labels, RNG states, config,
    epoch and step."""
    problems = _model_part_problems(ckpt)  # a mistyped 'config' among them
    if ckpt.get("config") is None:
        problems.append("'config' is missing")
    for key, kind in _RESUME_PARTS.items():
        value = ckpt.get(key)
        if value is None:
            problems.append(f"{key!r} is missing")
        elif not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"{key!r} is a {type(value).__name__}, not a{'n' if kind is int else ''} "
                            f"{kind.__name__}")
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}. {RESUME_FIX}")
