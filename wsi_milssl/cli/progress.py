"""Progress for the CLI: the library's ProgressEvents as tqdm bars on a terminal, as log lines otherwise.

On a terminal (stderr is a TTY) every stage gets a tqdm bar. When stderr is not a terminal (a batch
job, ``nohup``, ``2> run.log``, a container's log) bars are replaced by one timestamped line per
finished item of a top-level stage, that is one per slide, epoch and pipeline stage::

    2026-11-26 09:51:02 run 4/6: train
    2026-11-26 09:51:40 train 1/50 epoch: epoch 1 (loss 0.6931)
    2026-11-26 09:52:03 tile 3/270 slide: Tumor_003 (ok)

plus, at most once a minute, a line for the item in progress (``train-epoch 81920/165000 inst``),
so a long epoch or slide never leaves the log silent. ``--log-file FILE`` receives the same lines
(and the log records) whether or not there is a terminal; ``-q`` drops them from stderr.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

from wsi_milssl.events import ProgressEvent
from wsi_milssl.paths import escaped_text

__all__ = ["TqdmProgress", "configure_progress_lines", "progress_line", "LINE_LOGGER", "SUBSTAGE_INTERVAL_S"]

#: The logger the progress lines go to (its handlers are set by :func:`configure_progress_lines`).
LINE_LOGGER = logging.getLogger("wsi_milssl.progress")
LINE_LOGGER.propagate = False
LINE_LOGGER.setLevel(logging.INFO)

#: Seconds between two lines about the item in progress of a sub-stage (``train-epoch``, ``tile-patches``).
SUBSTAGE_INTERVAL_S = 60.0

_STATE = {"bars": None}  # None: bars on a terminal (stderr is a TTY); False: never (-q)


class EscapingFormatter(logging.Formatter):
    """A formatter whose lines name a file of another encoding (a surrogate escape in its name) escaped, ``\\udce9``:
    logging printed its traceback for such a record and dropped it (review EY)."""

    def format(self, record: logging.LogRecord) -> str:
        return escaped_text(super().format(record))


def configure_progress_lines(*, stderr: bool, log_handler: logging.Handler | None = None,
                             bars: bool | None = None, tag: str = "") -> None:
    """Where progress lines go: to stderr (``stderr``) and/or to ``log_handler`` (``--log-file``).
    ``bars``: False never draws tqdm bars (``-q``), None draws them when stderr is a terminal. ``tag``
    follows the timestamp of the lines on stderr (``[rank 1] ``: a torchrun rank other than 0)."""
    for handler in list(LINE_LOGGER.handlers):
        LINE_LOGGER.removeHandler(handler)
    if stderr:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(EscapingFormatter(f"%(asctime)s {tag}%(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
        LINE_LOGGER.addHandler(handler)
    if log_handler is not None:
        LINE_LOGGER.addHandler(log_handler)
    _STATE["bars"] = bars


def progress_line(event: ProgressEvent) -> str:
    """The text of one progress line: ``stage done/total unit: item (message)``."""
    if event.stage == "pipeline":
        if event.item:
            return f"run {event.done + 1}/{event.total}: {event.item}"
        return f"run {event.done}/{event.total} stages done"
    total = "?" if event.total is None else str(event.total)
    text = f"{event.stage} {event.done}/{total} {event.unit}"
    if event.item:
        text += f": {event.item}"
    if event.message:
        text += f" ({event.message})"
    return text


class TqdmProgress:
    """A ProgressCallback: one tqdm bar per event stage on a terminal, log lines otherwise (see the
    module docstring); use as a context manager."""

    def __init__(self, *, disable: bool | None = None) -> None:
        self._bars: dict[str, tqdm] = {}
        if disable is None:
            disable = (not sys.stderr.isatty()) if _STATE["bars"] is None else not _STATE["bars"]
        self._disable = disable
        self._last_sub: dict[str, float] = {}

    def _line(self, event: ProgressEvent) -> None:
        if not LINE_LOGGER.handlers:
            return
        if event.stage.count("-") == 0:
            if event.stage == "pipeline" or event.done > 0:
                LINE_LOGGER.info(progress_line(event))
            return
        # a sub-stage: a line for the item in progress, at most once per SUBSTAGE_INTERVAL_S
        now = time.monotonic()
        last = self._last_sub.setdefault(event.stage, now)
        if event.done > 0 and now - last >= SUBSTAGE_INTERVAL_S:
            self._last_sub[event.stage] = now
            LINE_LOGGER.info(progress_line(event))

    def __call__(self, event: ProgressEvent) -> None:
        self._line(event)
        if self._disable:
            return
        bar = self._bars.get(event.stage)
        if bar is None:
            bar = tqdm(total=event.total, desc=event.stage, unit=event.unit, disable=self._disable,
                       leave=event.stage.count("-") == 0, dynamic_ncols=True)
            self._bars[event.stage] = bar
        if event.total is not None and bar.total != event.total:
            bar.reset(total=event.total)
        postfix = " ".join(p for p in (event.item, event.message) if p)
        if postfix:
            bar.set_postfix_str(postfix, refresh=False)
        if event.done != bar.n:
            bar.update(event.done - bar.n)  # redrawn at most every tqdm mininterval (0.1 s), not per event
        if event.total is not None and event.done >= event.total:
            # closed when done: its time and rate are the stage's (review BX: a top-level bar ran on until the
            # `with` block ended); the stage's next pass (another slide set) gets a new bar
            bar.close()
            del self._bars[event.stage]

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def __enter__(self) -> "TqdmProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
