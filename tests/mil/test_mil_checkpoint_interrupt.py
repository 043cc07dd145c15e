"""Ctrl-C while a checkpoint is written (review BC, in passing): torch.save turned the KeyboardInterrupt raised
inside its writer into "RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos" (writing to a file),
so an interrupted `train` ended with a traceback instead of "interrupted", and the epoch's checkpoint was lost. The
save now finishes, then the interrupt takes effect (on the old code the first test finds no last.pt)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from wsi_milssl.mil.checkpoint import interrupt_after, read_checkpoint, save_checkpoint


class _InterruptedFile:
    """A file whose first write is met by a Ctrl-C (SIGINT to this process), as a slow disk write would be."""

    def __init__(self, fh):
        self.fh, self.fired = fh, False

    def write(self, data):
        if not self.fired:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)


@pytest.fixture()
def python_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the CLI
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_save_is_an_interrupt_once_the_checkpoint_is_complete(tmp_path, monkeypatch, python_sigint):
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, fh: real_save(obj, _InterruptedFile(fh)))
    weights = torch.arange(10_000, dtype=torch.float32)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"model": {"w": weights}, "epoch": 3}, tmp_path / "last.pt")
    saved = read_checkpoint(tmp_path / "last.pt")
    assert saved["epoch"] == 3 and torch.equal(saved["model"]["w"], weights)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


def test_the_handler_is_given_back_and_a_block_without_ctrl_c_runs_as_it_is(python_sigint):
    with interrupt_after():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(ValueError):  # the block's own error is not replaced
        with interrupt_after():
            raise ValueError("x")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_interrupts_at_once(python_sigint):
    with pytest.raises(KeyboardInterrupt):
        with interrupt_after():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handlers run between bytecodes
                pass
            raise AssertionError("the second Ctrl-C did not interrupt the block")


def test_outside_the_main_thread_the_block_runs_as_it_is():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_run_in_block()))
    thread.start()
    thread.join()
    assert seen == ["ran"]


def _run_in_block() -> str:
    with interrupt_after():
        return "ran"
