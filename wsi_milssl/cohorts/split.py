"""Seeded, stratified splits of labelled slides, one way for every stage: ``prepare folder``'s held-out test
set and ``run``'s validation slides (:func:`wsi_milssl.pipeline.split_train_val`).

Slides are split one by one, or, where a labels file names each slide's patient
(:func:`wsi_milssl.cohorts.read_label_groups`), by whole patients: a patient's slides all go to one side.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from wsi_milssl.cohorts.labels import read_label_groups
from wsi_milssl.cohorts.names import name_key, stem_key

__all__ = ["label_groups_for", "stratified_split"]


def label_groups_for(labels_csv: str | os.PathLike, names: Iterable[str], *,
                     column: str | None = None) -> tuple[str | None, dict[str, str]]:
    """(the labels file's patient column as written, ``{name: patient}`` of ``names``, matched as slide stems
    are: :func:`wsi_milssl.cohorts.stem_key`) from :func:`wsi_milssl.cohorts.read_label_groups` (``column``: the
    header column to read, any case; default the first of :data:`wsi_milssl.cohorts.GROUP_COLUMNS`); (None, {})
    without such a column. A name whose patient cell is empty, or that the file does not list, is left out (a
    patient of its own). Raises LabelsError as :func:`wsi_milssl.cohorts.read_label_groups` does."""
    found = read_label_groups(labels_csv, column=column)
    if found is None:
        return None, {}
    column, groups = found
    by_key = {stem_key(s): g for s, g in groups.items()}
    return column, {s: by_key[stem_key(s)] for s in names if stem_key(s) in by_key}


def _n_held(n: int, fraction: float) -> int:
    """How many of a class's ``n`` items (slides or patients) are held out: ``round(n * fraction)``, at least one
    and never all of them when the class has two or more, none of a class of one."""
    held = int(round(n * fraction))
    return min(max(held, 1), n - 1) if n >= 2 else 0


def stratified_split(labels: Mapping[str, int], *, fraction: float, seed: int,
                     groups: Mapping[str, str] | None = None,
                     key: Callable[[str], Any] | None = None) -> tuple[list[str], list[str]]:
    """(kept, held out): a seeded split of the names of ``labels`` ({name: 0/1}), stratified by label:
    ``fraction`` of each class goes to the held-out side, at least one when the class has two or more (never
    all of it), none of a class of one. Each class's names are sorted (by ``key``), shuffled with
    ``numpy.random.default_rng(seed)`` and the first ones held out, classes in ascending order; both lists
    come back sorted by ``key``.

    With ``groups`` ({name: patient}; not empty) whole patients are split instead: a patient's names all go to
    one side, patients stratified by their highest label (a patient with a tumour slide counts as tumour),
    ``fraction`` of each class of patients held out as above; a name without a patient is a patient of its
    own. Patient names are matched case- and Unicode-form-insensitively (:func:`wsi_milssl.cohorts.names.name_key`)."""
    rng = np.random.default_rng(seed)
    kept: list[str] = []
    held: list[str] = []
    if not groups:
        for label in sorted(set(labels.values())):
            members = sorted((s for s, v in labels.items() if v == label), key=key)
            rng.shuffle(members)
            n = _n_held(len(members), fraction)
            held += members[:n]
            kept += members[n:]
        return sorted(kept, key=key), sorted(held, key=key)
    units: dict[str, list[str]] = {}
    for s in sorted(labels, key=key):
        unit = f"patient:{name_key(groups[s])}" if groups.get(s) else f"slide:{name_key(s)}"
        units.setdefault(unit, []).append(s)
    for label in sorted({max(labels[s] for s in names) for names in units.values()}):
        chosen = sorted(u for u, names in units.items() if max(labels[s] for s in names) == label)
        rng.shuffle(chosen)
        n = _n_held(len(chosen), fraction)
        held += [s for u in chosen[:n] for s in units[u]]
        kept += [s for u in chosen[n:] for s in units[u]]
    return sorted(kept, key=key), sorted(held, key=key)
