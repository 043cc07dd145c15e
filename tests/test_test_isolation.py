"""The autouse fixtures of tests/conftest.py give every test the process state the session started with; the two
tests here run in this order (pytest keeps a file's order, and a file's tests share one worker), the first changing
the state, the second reading it. Each compares with the state recorded when the file was collected (after
tests/conftest.py shared the threads out among the workers), so either one also runs alone."""

from __future__ import annotations

import logging

import torch

#: the session's state, which the fixtures restore
_FOUND = {"threads": torch.get_num_threads(), "level": logging.getLogger().level}


def test_a_test_that_changes_the_process_state():
    assert (torch.get_num_threads(), logging.getLogger().level) == (_FOUND["threads"], _FOUND["level"])
    torch.set_num_threads(1 if _FOUND["threads"] != 1 else 2)  # as fit(threads=1) leaves it
    logging.getLogger().setLevel(logging.CRITICAL)  # as main([..., "-q"]) leaves it
    assert torch.get_num_threads() != _FOUND["threads"]


def test_the_next_test_starts_from_the_session_state():
    assert torch.get_num_threads() == _FOUND["threads"]
    assert logging.getLogger().level == _FOUND["level"]
