"""The autouse fixtures of tests/conftest.py give every test the process state the session started with; the two
tests here run in this order (pytest keeps a file's order), the first changing the state, the second reading it."""

from __future__ import annotations

import logging

import torch

#: the state the first test found (the session's, which the fixtures restore)
_FOUND: dict[str, int] = {}


def test_a_test_that_changes_the_process_state():
    _FOUND.update(threads=torch.get_num_threads(), level=logging.getLogger().level)
    torch.set_num_threads(1 if _FOUND["threads"] != 1 else 2)  # as fit(threads=1) leaves it
    logging.getLogger().setLevel(logging.CRITICAL)  # as main([..., "-q"]) leaves it
    assert torch.get_num_threads() != _FOUND["threads"]


def test_the_next_test_starts_from_the_session_state():
    assert torch.get_num_threads() == _FOUND["threads"]
    assert logging.getLogger().level == _FOUND["level"]
