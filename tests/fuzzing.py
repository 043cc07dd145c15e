"""Shared settings and helpers of the fuzz suites (issue 14 deliverable 3).

Each fuzz test runs twice: in the default run with a modest, derandomised number of examples (the
whole suite in well under a minute), and under ``pytest -m slow`` with many random examples. Every
example must give a result or the project's own error (``WsiMilsslError``), within the deadline.
"""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = ["DEFAULT", "LONG", "mutated", "json_values"]

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

#: The default run: reproducible (derandomize), no example database (hypothesis still keeps a small cache in
#: ./.hypothesis, which ignores itself with its own .gitignore).
DEFAULT = settings(max_examples=150, deadline=timedelta(seconds=5), derandomize=True, database=None,
                   suppress_health_check=_QUIET)
#: ``pytest -m slow``: many random examples.
LONG = settings(max_examples=1500, deadline=timedelta(seconds=20), database=None, suppress_health_check=_QUIET)


@st.composite
def mutated(draw, data: bytes, *, max_edits: int = 8) -> bytes:
    """``data`` with a few bytes overwritten, inserted or deleted, and maybe truncated."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, max_edits))):
        if not out:
            break
        pos = draw(st.integers(0, len(out) - 1))
        kind = draw(st.sampled_from(["set", "insert", "delete"]))
        if kind == "set":
            out[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        else:
            del out[pos:pos + draw(st.integers(1, 8))]
    if draw(st.booleans()) and out and draw(st.integers(0, 9)) == 0:
        out = out[: draw(st.integers(0, len(out) - 1))]
    return bytes(out)


#: Numbers a hostile or broken file may hold where a coordinate or size is expected.
NUMBERS = st.one_of(
    st.integers(-10**6, 10**6), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1e308, -1e308, 5e-324, 2**63, 2**64, 10**400]),
)


def json_values(max_leaves: int = 20):
    """Arbitrary JSON-like values (numbers including NaN/Infinity and huge integers, strings, lists, objects)."""
    leaves = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12))
    return st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                        max_leaves=max_leaves)
