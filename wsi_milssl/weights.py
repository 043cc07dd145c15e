"""Reading weights and checkpoint files safely: ``torch.load(..., weights_only=True)`` only, and each kind
of failure one line naming the file and what it is.

- :func:`load_torch_file`: a file written by ``torch.save`` holding only tensors, numbers, strings and plain
  containers. A TorchScript archive (``torch.jit.save``), a file holding other pickled Python objects, an
  empty, truncated or damaged file and a file that is no PyTorch file each get their own CheckpointError;
  nothing else of the file runs or loads.
- :func:`read_state_dict`: a state dict from a weights file: a ``.safetensors`` file, a ``torch.save`` state
  dict, or a checkpoint holding one under ``state_dict`` (Lightning) or ``model`` (wsi-milssl).
- :func:`strip_prefixes`: drops wrapper prefixes (``module.``, ``model.``, ``encoder.``, ``backbone.``, also
  stacked, e.g. ``module.model.``) where that makes the names match a module's own.

``features --weights`` (:mod:`wsi_milssl.features.encoders`) and ``train --weights``
(:mod:`wsi_milssl.mil.models`) read weights files by these rules; checkpoints
(:func:`wsi_milssl.mil.checkpoint.read_checkpoint`) through :func:`load_torch_file`.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from wsi_milssl.errors import CheckpointError, ConfigError

__all__ = ["load_torch_file", "read_state_dict", "strip_prefixes", "WRAPPER_PREFIXES", "SAVE_STATE_DICT_FIX"]

#: Prefixes that wrappers put before a module's own tensor names (DataParallel, Lightning, SSL frameworks).
WRAPPER_PREFIXES = ("module.", "model.", "encoder.", "backbone.")
#: Keys under which a checkpoint holds its model's state dict: Lightning's, then wsi-milssl's.
STATE_DICT_KEYS = ("state_dict", "model")
#: The fix for a weights file that is not a state dict.
SAVE_STATE_DICT_FIX = ("Fix: save the weights alone with torch.save(model.state_dict(), path), or pass a "
                       ".safetensors file.")

#: The checkpoints in the folder of a training run (``wsi-milssl train --out``), best first.
RUN_CHECKPOINTS = ("best.pt", "last.pt")
#: The fix for a file that safe loading cannot read for its pickle instructions (not for what it holds).
PROTOCOL_FIX = ("Fix: where you trust the file, load it and save it again with torch.save's default pickle "
                "protocol (torch.save(obj, path) without pickle_protocol), and pass the new file.")

#: How a file of torch's older (non-zip) format starts: its magic number, pickled (protocol 2 by default).
_LEGACY_HEADS = tuple(pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=p)
                      for p in range(2, pickle.HIGHEST_PROTOCOL + 1))
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def load_torch_file(path: str | os.PathLike, *, fix: str = SAVE_STATE_DICT_FIX,
                    map_location: str | torch.device = "cpu", mmap: bool = False, verify: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; a file it cannot load that way raises one CheckpointError
    line: ``"{path}: <what the file is>. {fix}"`` (:data:`PROTOCOL_FIX` instead of ``fix`` for a file written
    with a pickle protocol that safe loading cannot read). torch's warning about a pickle protocol other than
    its default is not shown: such a file either loads or gets that error. The folder of a training run
    is answered with its checkpoints to pass instead. ``verify``: check every record of the zip archive against
    its CRC-32 first (one more read of the file): torch.load does not, so a flipped bit loads as a wrong weight."""
    path = Path(path)
    checkpoints = [path / name for name in RUN_CHECKPOINTS if path.is_dir() and (path / name).is_file()]
    if checkpoints:
        raise CheckpointError(f"{path}: is the folder of a training run, not a weights file. Fix: pass its "
                              f"checkpoint, {' or '.join(map(str, checkpoints))}.")
    if path.is_file() and not os.access(path, os.R_OK):  # (review CB: the fix was to save a state dict)
        raise CheckpointError(f"{path}: cannot be read (permission denied). Fix: ask its owner for read access, or "
                              "copy it to a place you can read.")
    what = _refusal(path, verify=verify)
    if what is None:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except Exception as exc:  # noqa: BLE001 - every pickle, zip or format error of torch
            what, fix = _load_failure(path, exc, fix)
    raise CheckpointError(f"{path}: {what}. {fix}")


def _refusal(path: Path, *, verify: bool = False) -> str | None:
    """What keeps ``path`` from loading, found before torch reads it (None: let torch try); ``verify``: see
    :func:`load_torch_file`."""
    if path.is_dir():
        return "is a folder, not a file"
    if not path.is_file():
        return "file not found"
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(max(len(h) for h in _LEGACY_HEADS))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size == 0:
        return "is empty (0 bytes; an interrupted copy or save?)"
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                records = {name.split("/", 1)[-1] for name in archive.namelist()}
                # torch.save with serialization.config.save.compute_crc32 = False writes every CRC-32 as 0: nothing
                # to check against (review BY: such checkpoints were called damaged)
                checked = verify and any(info.CRC for info in archive.infolist() if info.file_size)
                damaged = archive.testzip() if checked else None
        except (zipfile.BadZipFile, OSError, ValueError):
            return "is truncated or damaged (its zip archive cannot be read; an interrupted copy or save?)"
        if damaged is not None:  # (review BW: a bit flipped on disk loaded as a weight of 4087)
            return (f"is damaged: its record {damaged} does not match the checksum saved with it (a disk or copy "
                    "that changed bytes)")
        if "constants.pkl" in records:  # what torch.load takes for a TorchScript archive
            return "is a TorchScript archive (torch.jit.save): not loaded, as it holds code, not only tensors"
        if "data.pkl" not in records:
            return "is a zip archive, but not a PyTorch file (torch.save writes one holding data.pkl)"
        return None
    if head.startswith(b"\x80") and not head.startswith(_LEGACY_HEADS):
        return "is a pickle file not written by torch.save: not loaded, for safety (unpickling it could run code)"
    if not head.startswith(_LEGACY_HEADS):
        return "is not a PyTorch file (neither torch.save's zip archive nor its older format)"
    return None


def _load_failure(path: Path, exc: Exception, fix: str) -> tuple[str, str]:
    """What a ``torch.load`` failure on a file that looked like a PyTorch file says about it, and the fix."""
    text = _ANSI.sub("", str(exc))
    if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in text:
        operand = re.search(r"Unsupported operand (\d+)", text)
        if operand:  # e.g. pickle_protocol=4's FRAME (149): how the file is written, not what it holds
            return (f"uses pickle instructions that safe (weights-only) loading cannot read (Unsupported operand "
                    f"{operand.group(1)}: a pickle protocol other than torch.save's default)", PROTOCOL_FIX)
        if re.search(r"GLOBAL|allowlisted|add_safe_globals", text):
            found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
            named = f", e.g. {found.group(1)}" if found else ""
            return (f"holds pickled Python objects, not only tensors, numbers, strings and plain containers{named}: "
                    "not loaded, for safety (unpickling them could run code)", fix)
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        return (f"cannot be loaded safely (weights-only){f' ({detail.group(1)[:200]})' if detail else ''}", fix)
    if isinstance(exc, (EOFError, RuntimeError)) and re.search(r"EOF|corrupt|zip archive|central directory", text):
        return "is truncated or damaged (an interrupted copy or save?)", fix
    first = (text.strip().splitlines() or [""])[0][:200]
    return f"cannot be loaded as a PyTorch file ({type(exc).__name__}{': ' + first if first else ''})", fix


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in a weights file: ``.safetensors``, or a ``torch.save`` file holding a state dict
    or a checkpoint with one under ``state_dict`` or ``model``. Raises ConfigError when reading
    ``.safetensors`` needs the missing package safetensors, CheckpointError (one line naming the file)
    otherwise: :func:`load_torch_file`'s, or a file that holds something else than names of tensors (the
    entries that are not tensors are named; a checkpoint of several models, e.g. DINO's teacher and
    student, gets how to pick one)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    state = load_torch_file(path)
    if isinstance(state, Mapping):
        for key in STATE_DICT_KEYS:  # a Lightning or wsi-milssl checkpoint
            if isinstance(state.get(key), Mapping):
                state = state[key]
                break
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict (names of tensors). "
                              f"{SAVE_STATE_DICT_FIX}")
    others = [(k, v) for k, v in state.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if others:
        listed = ", ".join(f"{k}: {_kind(v)}" for k, v in others[:5]) + (" ..." if len(others) > 5 else "")
        models = [k for k, v in others if _is_state_dict(v)]
        fix = (f"Fix: save the state dict wanted alone, e.g. torch.save(checkpoint[{models[0]!r}], "
               f"'{models[0]}.pt'), and pass that file." if models else SAVE_STATE_DICT_FIX)
        raise CheckpointError(f"{path}: is not a state dict: {len(others)} of its {len(state)} entries "
                              f"{'is not a tensor' if len(others) == 1 else 'are not tensors'} ({listed}). {fix}")
    return dict(state)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError(f"{path}: reading .safetensors needs the package safetensors (installed with timm). "
                          "Fix: pip install safetensors, or convert the file to a torch state dict.") from None
    if not path.is_file():
        raise CheckpointError(f"{path}: {'is a folder, not a file' if path.is_dir() else 'file not found'}.")
    try:
        return dict(load_file(str(path), device="cpu"))
    except Exception as exc:  # noqa: BLE001 - any format error
        first = (_ANSI.sub("", str(exc)).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"{path}: cannot be read as safetensors ({first}). Fix: pass a complete "
                              ".safetensors file, or a state dict saved with torch.save.") from None


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def _kind(value: Any) -> str:
    if _is_state_dict(value):
        return f"state dict of {len(value)} tensors"
    return type(value).__name__


def strip_prefixes(state: dict[str, torch.Tensor], own: set[str]) -> dict[str, torch.Tensor]:
    """``state`` with wrapper prefixes (:data:`WRAPPER_PREFIXES`, also stacked: ``module.model.``) dropped
    while that makes more of its names match ``own`` (a module's tensor names). A strip that would give
    two tensors one name is not taken."""
    while True:
        best, hits = state, len(own & set(state))
        for chain in sorted({c for k in state for c in _prefix_chains(k)}):
            stripped = {k[len(chain):] if k.startswith(chain) else k: v for k, v in state.items()}
            if len(stripped) == len(state) and len(own & set(stripped)) > hits:
                best, hits = stripped, len(own & set(stripped))
        if best is state:
            return state
        state = best


def _prefix_chains(key: str) -> list[str]:
    """The runs of wrapper prefixes ``key`` starts with: 'module.model.x' -> ['module.', 'module.model.']."""
    chains, chain = [], ""
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if key.startswith(p, len(chain))), None)
        if prefix is None:
            return chains
        chain += prefix
        chains.append(chain)
