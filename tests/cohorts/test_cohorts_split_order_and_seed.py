"""Review EG (mutation test, round 2): nothing held that the split does not depend on the order the slides come in
(folder layout, labels-file order), nor that `prepare folder --seed` draws the test slides (a run ignoring it went
unnoticed: the test only read the seed back from the recorded command)."""

from __future__ import annotations

from pathlib import Path

from wsi_milssl.cli import main
from wsi_milssl.cohorts import read_labels, stratified_split


def test_the_split_does_not_depend_on_the_order_the_names_come_in():
    labels = {f"s{i:02d}": i % 2 for i in range(20)}
    shuffled = {k: labels[k] for k in sorted(labels, key=lambda s: s[::-1])}
    split = stratified_split(labels, fraction=0.3, seed=0)
    assert split == stratified_split(shuffled, fraction=0.3, seed=0)
    assert split == stratified_split(dict(reversed(labels.items())), fraction=0.3, seed=0)


def _touch(path: Path, text: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"placeholder slide {path}" if text is None else text)  # not empty, each its own bytes
    return path


def test_prepare_folder_holds_out_the_test_slides_its_seed_draws(tmp_path, monkeypatch):
    labels = {f"case{i:02d}": i % 2 for i in range(12)}
    for s, v in labels.items():
        _touch(tmp_path / "fo" / f"{s}.svs")
        if v:
            _touch(tmp_path / "fo" / f"{s}.xml", "<ASAP_Annotations><Annotations /></ASAP_Annotations>\n")
    _touch(tmp_path / "fo" / "labels.csv", "".join(f"{s},{v}\n" for s, v in labels.items()))
    monkeypatch.chdir(tmp_path)
    held = {}
    for seed in (0, 1):
        assert main(["prepare", "folder", "--slides", "fo", "--labels", "fo/labels.csv", "--test-fraction", "0.5",
                     "--seed", str(seed), "--out", f"pf{seed}"]) == 0
        held[seed] = sorted(read_labels(tmp_path / f"pf{seed}" / "cohort" / "test_labels.csv"))
        assert held[seed] == stratified_split(labels, fraction=0.5, seed=seed, key=str.casefold)[1]
    assert held[0] != held[1]
