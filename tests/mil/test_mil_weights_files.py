"""`train --weights` files as they come: each file that cannot be used is one error line naming it and what it
is (never torch's multi-line advice to load unsafely), and files read by the same rules as `features --weights`
(wrapper prefixes, also stacked, stripped; Lightning's ``state_dict`` unwrapped). A damaged checkpoint is one
line too."""

from __future__ import annotations

import re
import struct
import warnings

import pytest
import torch

from wsi_milssl.cli import main
from wsi_milssl.errors import CheckpointError
from wsi_milssl.mil import read_checkpoint
from wsi_milssl.mil.models import create_model
from wsi_milssl.mil.resnet import ResNet18


class _Payload:
    """Unpickling this calls print: a file holding it must not be loaded."""

    def __reduce__(self):
        return (print, ("PWNED",))


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return ResNet18(num_classes=2).state_dict()


def _assert_one_safe_line(err: str) -> None:
    """One error line: no traceback, no torch warning, no escape codes, no advice to load unsafely."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Warning" not in err and "\x1b" not in err
    assert "weights_only=False" not in err and "add_safe_globals" not in err


@pytest.fixture(scope="module")
def image_stores(image_store_factory, tmp_path_factory):
    return image_store_factory(tmp_path_factory.mktemp("weights_stores"), n_bags=2, n_patches=8)


def _train(stores, weights, out, capture):
    paths, labels = stores
    rc = main(["train", str(paths[0].parent), "--labels", str(labels), "--out", str(out), "--epochs", "1",
               "--weights", str(weights), "--threads", "1", "--no-plots"])
    captured = capture.readouterr()
    assert "PWNED" not in captured.out
    return rc, captured.err


def test_a_state_dict_holding_a_non_tensor_is_one_error_naming_the_entry(tmp_path, image_stores, capsys):
    """It was AttributeError: 'list' object has no attribute 'shape', with a full traceback."""
    state = _state()
    state["conv1.weight"] = [1, 2]
    path = tmp_path / "w_nontensor.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"w_nontensor.pt: is not a state dict: 1 of its \d+ entries is not a "
                                              r"tensor \(conv1.weight: list\)"):
        create_model("resnet18", weights_path=str(path))
    rc, err = _train(image_stores, path, tmp_path / "run", capsys)
    assert rc == 1 and "conv1.weight: list" in err
    _assert_one_safe_line(err)


def _unsafe_files(tmp_path):
    model = ResNet18(num_classes=2)
    torch.save({"state_dict": model.state_dict(), "x": _Payload()}, tmp_path / "w_evil.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        torch.jit.script(model.eval()).save(str(tmp_path / "w_ts.pt"))
    (tmp_path / "w_text.pt").write_text("not weights\n")
    (tmp_path / "w_empty.pt").write_bytes(b"")
    torch.save(model.state_dict(), tmp_path / "whole.pt")
    (tmp_path / "w_cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:5000])
    return {"w_evil.pt": r"holds pickled Python objects, not only tensors.*e\.g\. print: not loaded, for safety",
            "w_ts.pt": r"is a TorchScript archive \(torch.jit.save\): not loaded",
            "w_text.pt": r"is not a PyTorch file",
            "w_empty.pt": r"is empty \(0 bytes",
            "w_cut.pt": r"is truncated or damaged"}


def test_files_that_cannot_be_loaded_safely_are_one_line_each(tmp_path, image_stores, capfd, recwarn):
    """They got torch's ~6-line message with escape codes advising weights_only=False, 'cannot load ... (101)'
    for a text file and '()' for an empty one; TorchScript first warned that it was 'dispatching to
    torch.jit.load'."""
    for name, what in _unsafe_files(tmp_path).items():
        with pytest.raises(CheckpointError, match=rf"{name}: {what}.*Fix: save the weights alone with "
                                                  r"torch.save\(model.state_dict\(\), path\)") as caught:
            create_model("resnet18", weights_path=str(tmp_path / name))
        _assert_one_safe_line(str(caught.value))
        rc, err = _train(image_stores, tmp_path / name, tmp_path / f"run_{name}", capfd)
        assert rc == 1 and name in err and "PWNED" not in err
        _assert_one_safe_line(err)
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]


def test_train_weights_read_like_features_weights(tmp_path, caplog):
    """train --weights stripped no prefixes and did not unwrap Lightning's state_dict, which features --weights
    took; stacked prefixes (module.model.) were not stripped by either."""
    state = _state()
    files = {"w_m.pt": {"module." + k: v for k, v in state.items()},
             "w_mm.pt": {"module.model." + k: v for k, v in state.items()},
             "w_lightning.pt": {"state_dict": {"model." + k: v for k, v in state.items()}, "epoch": 3}}
    for name, content in files.items():
        torch.save(content, tmp_path / name)
        model = create_model("resnet18", weights_path=str(tmp_path / name))
        for key, value in model.state_dict().items():
            assert torch.equal(value, state[key]), (name, key)
    assert "skipped" not in caplog.text


def test_train_weights_under_the_home_folder_are_read(tmp_path, monkeypatch):
    """Review BR: `weights_path = "~/w.pt"` passed the pipeline's check (which expands ~) and then failed in
    train, after the finished run had been set aside."""
    monkeypatch.setenv("HOME", str(tmp_path))
    state = _state()
    torch.save(state, tmp_path / "w.pt")
    model = create_model("resnet18", weights_path="~/w.pt")
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


def test_a_checkpoint_of_several_models_names_them_and_how_to_pick_one(tmp_path):
    """It said 'expected a state dict (a mapping of tensors); got dict'."""
    state = _state()
    path = tmp_path / "w_dino.pt"
    torch.save({"teacher": {"backbone." + k: v for k, v in state.items()}, "student": state, "epoch": 1}, path)
    with pytest.raises(CheckpointError, match=r"w_dino.pt: is not a state dict: 3 of its 3 entries are not tensors "
                                              r"\(teacher: state dict of \d+ tensors, student: state dict of \d+ "
                                              r"tensors, epoch: int\)\. Fix: save the state dict wanted alone, e\.g\. "
                                              r"torch.save\(checkpoint\['teacher'\], 'teacher.pt'\)"):
        create_model("resnet18", weights_path=str(path))
    torch.save(torch.load(path, weights_only=True)["teacher"], tmp_path / "teacher.pt")  # the fix, as it says
    model = create_model("resnet18", weights_path=str(tmp_path / "teacher.pt"))
    assert torch.equal(model.conv1.weight, state["conv1.weight"])


@pytest.fixture(scope="module")
def trained_run(mil_csv, tmp_path_factory):
    run = tmp_path_factory.mktemp("weights_ckpt") / "run"
    assert main(["train", str(mil_csv), "--out", str(run), "--epochs", "1", "--threads", "1", "--no-plots"]) == 0
    return run


def test_a_truncated_last_pt_on_resume_is_one_line_without_passing_another_file(trained_run, tmp_path, capsys):
    """It said 'cannot load checkpoint (PytorchStreamReader failed ...). Re-run training or pass another file'
    (a resume cannot take another file)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    last = run / "last.pt"
    last.write_bytes(last.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match=r"last.pt: is truncated or damaged"):
        read_checkpoint(last)
    assert main(["train", "--resume", str(run), "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert "last.pt: is truncated or damaged" in err and "so the run cannot be resumed from it" in err
    assert "Fix: put the run's complete last.pt back" in err  # RESUME_FIX: a resume reads last.pt with its own fix
    assert "pass another file" not in err and "PytorchStreamReader" not in err
    _assert_one_safe_line(err)


def test_a_checkpoint_with_a_flipped_bit_is_refused_naming_the_damaged_record(trained_run, tmp_path, capsys):
    """Review BW: torch.load does not check the CRC-32 the zip archive keeps of each record, so a bit flipped on
    disk loaded as a wrong weight (up to 4087) and heatmap and evaluate ran on it, exit 0."""
    import shutil
    import zipfile

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    last = run / "last.pt"
    with zipfile.ZipFile(last) as archive:  # the largest tensor record (torch stores records uncompressed)
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(last.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len  # the record's bytes, after its local header
    data[start + info.file_size // 2] ^= 0x10  # one bit in the middle of the tensor
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"last.pt: is damaged: its record {re.escape(info.filename)} does "
                                              r"not match the checksum saved with it"):
        read_checkpoint(last)
    assert main(["train", "--resume", str(run), "--epochs", "2"]) == 1
    err = capsys.readouterr().err
    assert "last.pt: is damaged: its record" in err and "Fix: put the run's complete last.pt back" in err


@pytest.mark.parametrize("name", ["digit-cnn", "digit-cnn-shift"])
def test_digit_cnn_weights_are_read_like_the_other_models(tmp_path, capsys, name):
    """`train --model digit-cnn --weights` loaded the file with a bare torch.load: the model's own last.pt gave a
    traceback (unexpected keys "format", "model", ...) and a text file 'KeyError: 101'. Now it reads weights by
    the rules of the other models: a run's checkpoint is unwrapped, every other file is one line."""
    from milcsv import make_mil_csv

    data = make_mil_csv(tmp_path / "digits.csv", n_bags=8, dim=16)
    args = ["--mode", "mil-csv", "--model", name, "--epochs", "1", "--threads", "1", "--no-plots"]
    assert main(["train", str(data), "--out", str(tmp_path / "run1"), *args]) == 0
    saved = torch.load(tmp_path / "run1" / "last.pt", weights_only=True)["model"]
    model = create_model(name, in_features=16, weights_path=str(tmp_path / "run1" / "last.pt"))
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())
    capsys.readouterr()
    assert main(["train", str(data), "--out", str(tmp_path / "run2"), *args,
                 "--weights", str(tmp_path / "run1" / "last.pt")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    (tmp_path / "notw.pt").write_text("hello\n")
    torch.save(create_model("mlp", in_features=16).state_dict(), tmp_path / "w_mlp.pt")
    for file, what in {"notw.pt": "is not a PyTorch file", "w_mlp.pt": "weights do not fit the model"}.items():
        assert main(["train", str(data), "--out", str(tmp_path / f"run_{file}"), *args,
                     "--weights", str(tmp_path / file)]) == 1
        err = capsys.readouterr().err
        assert f"{file}: {what}" in err, err
        _assert_one_safe_line(err)


def test_a_file_of_another_pickle_protocol_is_named_as_such_without_torchs_warning(tmp_path, image_stores, capfd,
                                                                                   recwarn):
    """torch.save(..., pickle_protocol=4) writes only tensors, yet safe loading cannot read it ('Unsupported
    operand 149'): it was called 'holds pickled Python objects ... not loaded, for safety', and torch's
    'Detected pickle protocol 4' warning was printed despite -q. A protocol-3 file, which safe loading reads,
    loads without the warning."""
    torch.save(_state(), tmp_path / "w_p4.pt", pickle_protocol=4)
    with pytest.raises(CheckpointError, match=r"w_p4.pt: uses pickle instructions that safe \(weights-only\) loading "
                                              r"cannot read \(Unsupported operand 149: a pickle protocol other than "
                                              r"torch.save's default\)\. Fix: where you trust the file, load it and "
                                              r"save it again with torch.save's default pickle protocol") as caught:
        create_model("resnet18", weights_path=str(tmp_path / "w_p4.pt"))
    assert "pickled Python objects" not in str(caught.value)
    rc, err = _train(image_stores, tmp_path / "w_p4.pt", tmp_path / "run", capfd)
    assert rc == 1 and "w_p4.pt: uses pickle instructions that safe (weights-only) loading cannot read" in err
    _assert_one_safe_line(err)
    torch.save(_state(), tmp_path / "w_p3.pt", pickle_protocol=3)
    create_model("resnet18", weights_path=str(tmp_path / "w_p3.pt"))
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


def test_a_run_folder_as_weights_names_its_checkpoints(trained_run, mil_csv, tmp_path, capsys):
    """`train --weights RUN` answered 'is a folder ... Fix: save the weights alone with torch.save(...)'; a run
    folder gets which of its files to pass. Any other folder stays 'is a folder, not a file'."""
    present = [n for n in ("best.pt", "last.pt") if (trained_run / n).is_file()]
    fix = " or ".join(str(trained_run / n) for n in present)
    with pytest.raises(CheckpointError) as caught:
        create_model("linear", in_features=8, weights_path=str(trained_run))
    assert str(caught.value) == (f"{trained_run}: is the folder of a training run, not a weights file. "
                                 f"Fix: pass its checkpoint, {fix}."), caught.value
    assert main(["train", str(mil_csv), "--out", str(tmp_path / "run"), "--epochs", "1", "--threads", "1",
                 "--no-plots", "--weights", str(trained_run)]) == 1
    err = capsys.readouterr().err
    assert f"Fix: pass its checkpoint, {fix}." in err
    _assert_one_safe_line(err)
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match=r"other: is a folder, not a file\. Fix: save the weights alone"):
        create_model("linear", in_features=8, weights_path=str(tmp_path / "other"))


def test_train_weights_holding_nan_are_refused_at_load(tmp_path):
    """Review AD's fixer: train --weights with a tensor holding NaN was loaded (features --weights refuses such
    weights), and the run then stopped at its first refresh with the diverged run's advice to lower the
    learning rate, which points at the wrong cause."""
    state = _state()
    key = next(k for k, v in state.items() if v.is_floating_point() and not k.startswith("fc."))
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    path = tmp_path / "w_nan.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=rf"w_nan\.pt: 1 tensors of these weights hold NaN or infinity "
                                              rf"\({re.escape(key)}\), so training would start from a broken model"):
        create_model("resnet18", weights_path=str(path))


def test_a_checkpoint_saved_without_checksums_loads(trained_run, tmp_path):
    """Review BY: torch.save with serialization.config.save.compute_crc32 = False (a faster save) writes every
    CRC-32 as 0; the checksum check called such checkpoints damaged."""
    import zipfile

    from torch.utils import serialization

    ckpt = torch.load(trained_run / "last.pt", weights_only=True)
    path = tmp_path / "last.pt"
    before = serialization.config.save.compute_crc32
    serialization.config.save.compute_crc32 = False
    try:
        torch.save(ckpt, path)
    finally:
        serialization.config.save.compute_crc32 = before
    with zipfile.ZipFile(path) as archive:
        assert not any(info.CRC for info in archive.infolist())
    assert read_checkpoint(path)["epoch"] == ckpt["epoch"]
