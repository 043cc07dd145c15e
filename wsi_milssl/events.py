"""Progress events. The library reports progress through a callback; only the CLI draws bars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ProgressEvent", "ProgressCallback", "emit"]


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a long-running job.

    ``stage`` names the job ("synth", "tile", ...), ``done``/``total`` count items of ``unit``
    (``total`` is None when unknown) and ``item`` names the current item (a slide stem, an epoch).
    """

    stage: str
    done: int
    total: int | None
    unit: str = "it"
    item: str = ""
    message: str = ""


ProgressCallback = Callable[[ProgressEvent], None]


def emit(callback: ProgressCallback | None, event: ProgressEvent) -> None:
    """Send ``event`` to ``callback`` when one is given."""
    if callback is not None:
        callback(event)
