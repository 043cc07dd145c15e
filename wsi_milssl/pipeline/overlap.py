"""A pipeline whose test set holds a training slide or bag is refused before any stage runs: the model would be
scored on what it trained or validated on, and its figures would look better than they are.

A slide (image data) or a feature file (feature data) counts as the same when it is one file under two names
(device and inode: links, another spelling) or a copy holding the same bytes
(:func:`wsi_milssl.cohorts.checks.same_content_groups`, which reads only files of equal sizes); two files that
only share a name (two folders) do not. A feature file of one slide is that slide's bag, under whatever name the
labels file gives it, and so is every feature file that records the same slide file (``slide_path``: its features
made again, at another precision or by another encoder). One that holds several bags (``bag_ids``, the MIL CSV
layout) shares a bag when its name is in both labels files too: one file of every bag, whose two labels files list
different bags, is a valid split.
Generated sets are other slides when their seeds differ, which :func:`wsi_milssl.pipeline.spec.load_pipeline`
requires.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from wsi_milssl.pipeline.spec import PipelineSpec


def refuse_test_in_training(spec: PipelineSpec) -> None:
    """ConfigError naming the pipeline, the first shared slides (bags) and the fix, when the test set holds a
    slide (bag) of the training set. Lists that cannot be read are left to the stage that reads them."""
    from wsi_milssl.errors import ConfigError

    if spec.mode == "features":
        shared = _shared_bags(spec)
        what, fix = ("bag(s)", "point [data].test_features at feature files of other slides, or take the bags off "
                     "one of the two labels files")
    else:
        shared = _shared_slides(spec)
        what, fix = "slide(s)", ("remove them from the test set or from the training set (the folder or slide list "
                                 "it reads)")
    if shared:
        raise ConfigError(f"{spec.source}: {len(shared)} {what} are in both the training and the test set ("
                          + ", ".join(shared[:3]) + (", ..." if len(shared) > 3 else "") + "): the model would be "
                          f"scored on {what[:-3]}s it trained or validated on. Fix: {fix}.")


def refuse_unlabelled_test_bags(spec: PipelineSpec) -> None:
    """Feature data: ConfigError naming the first bags and the fix when test feature files hold bags that the test
    labels file does not name; evaluate would refuse them, but only after training (review BZ). Files or lists
    that cannot be read are left to the stage that reads them."""
    from wsi_milssl.cohorts import read_labels
    from wsi_milssl.errors import ConfigError, WsiMilsslError
    from wsi_milssl.pipeline.digests import feature_file_bags, feature_files

    ds = spec.sets.get("test")
    if spec.mode != "features" or ds is None or ds.features is None or ds.labels is None:
        return
    try:
        labels = read_labels(ds.labels)
        files = feature_files(Path(ds.features))
    except (OSError, WsiMilsslError):
        return
    missing = [f"{name} in {f}" for f in files for name in (feature_file_bags(f) or []) if name not in labels]
    if missing:
        raise ConfigError(f"{spec.source}: {len(missing)} test bag(s) have no row in {ds.labels} ("
                          + ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "") + "), so evaluate "
                          "would stop after training. Fix: add a 'name,<0|1>' row for each, or move their files "
                          "out of [data].test_features.")


def _shared_slides(spec: PipelineSpec) -> list[str]:
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.tiling import find_slides

    if any(ds.synth is not None or ds.slides is None for ds in spec.sets.values()):
        return []
    try:  # a listed file that does not exist is the tile stage's error to report
        train, test = ([Path(p) for p in find_slides([spec.sets[s].slides], keep_missing=True) if Path(p).exists()]
                       for s in ("train", "test"))
    except WsiMilsslError:  # the tile stage says what is wrong with the lists
        return []
    return [_pair(a, b) for a, b in _same_files(train, test)]


def _shared_bags(spec: PipelineSpec) -> list[str]:
    from wsi_milssl.cohorts import read_labels
    from wsi_milssl.errors import WsiMilsslError
    from wsi_milssl.pipeline.digests import feature_file_bags, feature_file_slide, feature_files

    held: dict[Path, list[str]] = {}  # feature file: the bags it holds
    bags: dict[str, dict[Path, list[str]]] = {}  # set: {feature file: the bags of it that its labels name}
    for set_name in ("train", "test"):
        ds = spec.sets[set_name]
        try:
            labels = read_labels(ds.labels)
            files = feature_files(Path(ds.features))
        except (OSError, WsiMilsslError):  # the train and evaluate stages say what is wrong
            return []
        for f in files:
            held.setdefault(f, feature_file_bags(f) or [])
        bags[set_name] = {f: [b for b in held[f] if b in labels] for f in files}
    shared = []
    same = _same_files(list(bags["train"]), list(bags["test"]))
    for a, b in same:
        if len(held[b]) == 1:  # a file of one slide: the same bytes are the same bag, whatever the file's name,
            # labelled in the test labels file or not (review BZ: an unlabelled copy was found only after training)
            shared += [f"{name} in {_pair(a, b)}" for name in held[b] if bags["train"][a]]
        else:  # a file of several bags: its labels files may split them
            in_train = {name.casefold() for name in bags["train"][a]}
            shared += [f"{name} in {_pair(a, b)}" for name in bags["test"][b] if name.casefold() in in_train]
    # features of a training slide made again (another encoder precision, another folder: other bytes) are that
    # slide's bag too, as train --val finds them (review DB)
    copied = {b for _, b in same}
    slides = {feature_file_slide(a): a for a in bags["train"] if bags["train"][a]}
    slides.pop(None, None)
    for b in bags["test"]:
        a = slides.get(feature_file_slide(b)) if b not in copied else None
        if a is not None:
            shared += [f"{name} in {b} (of the slide {feature_file_slide(b)}, as {a})" for name in held[b]]
    return shared


def _same_files(train: Iterable[Path], test: Iterable[Path]) -> list[tuple[Path, Path]]:
    """(training file, test file) for each test file that is a training file (device and inode) or holds the same
    bytes as one; the first such training file by name."""
    from wsi_milssl.cohorts.checks import same_content_groups
    from wsi_milssl.cohorts.names import file_identity

    train, test = sorted(train), sorted(test)
    same: dict[Path, Path] = {}
    by_identity: dict[object, Path] = {}
    for p in train:
        by_identity.setdefault(file_identity(p), p)
    for p in test:
        if file_identity(p) in by_identity:
            same[p] = by_identity[file_identity(p)]
    in_train = set(train)
    for group in same_content_groups([*train, *test]):
        # a group holds one path per file; a test path that is a training file under another name is found above
        originals = sorted(p for p in group if p in in_train)
        if originals:
            for p in group:
                if p not in in_train:
                    same.setdefault(p, originals[0])
    return sorted(((a, b) for b, a in same.items()), key=lambda pair: pair[1])


def _pair(train: Path, test: Path) -> str:
    """How test file ``test`` is training file ``train``, the test file named first."""
    if train == test:
        return os.fspath(train)
    if os.path.samefile(train, test):
        return f"{test} = {train}"  # a link or a second (hard) link
    return f"{test} holds the same bytes as {train}"
