"""`heatmap --model` with a file that is no training checkpoint, or a damaged one: one error line naming the
file and what it is, without torch's warnings or its advice to load unsafely."""

from __future__ import annotations

import warnings

import pytest
import torch

from wsi_milssl.cli import main
from wsi_milssl.errors import CheckpointError
from wsi_milssl.inference.model import load_inference_model


def _heatmap(slide, model, out, capfd):
    rc = main(["heatmap", str(slide), "--model", str(model), "--out", str(out)])
    return rc, capfd.readouterr().err


def test_a_torchscript_archive_is_one_line_without_torch_warnings(tmp_path, tumour_slide, capfd, recwarn):
    """torch warned twice that it was 'dispatching to torch.jit.load' (from the run check and the checkpoint
    read), then gave its multi-line refusal advising weights_only=False."""
    from wsi_milssl.mil.resnet import ResNet18

    path = tmp_path / "w_ts.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        torch.jit.script(ResNet18(num_classes=2).eval()).save(str(path))
    with pytest.raises(CheckpointError, match=r"w_ts.pt: is a TorchScript archive \(torch.jit.save\): not loaded.*"
                                              r"Fix: pass RUN_DIR/best.pt or RUN_DIR/last.pt"):
        load_inference_model(path)
    rc, err = _heatmap(tumour_slide, path, tmp_path / "hm", capfd)
    assert rc == 1 and "w_ts.pt: is a TorchScript archive" in err
    assert len(err.strip().splitlines()) == 1, err
    assert "weights_only=False" not in err and "Warning" not in err
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]


def test_a_truncated_checkpoint_is_one_line(tmp_path, tumour_slide, checkpoint_factory, capfd):
    """It said 'cannot load checkpoint (PytorchStreamReader failed reading zip archive: ... a high likelihood
    that your checkpoint file is corrupted ...)'."""
    path = checkpoint_factory()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    rc, err = _heatmap(tumour_slide, path, tmp_path / "hm", capfd)
    assert rc == 1 and "best.pt: is truncated or damaged" in err
    assert len(err.strip().splitlines()) == 1, err
    assert "PytorchStreamReader" not in err
