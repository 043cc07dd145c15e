"""Progress bars for the CLI: turn the library's ProgressEvents into tqdm bars."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from wsi_milssl.events import ProgressEvent

__all__ = ["TqdmProgress"]


class TqdmProgress:
    """A ProgressCallback that keeps one tqdm bar per event stage; use as a context manager."""

    def __init__(self, *, disable: bool | None = None) -> None:
        self._bars: dict[str, tqdm] = {}
        self._disable = (not sys.stderr.isatty()) if disable is None else disable

    def __call__(self, event: ProgressEvent) -> None:
        bar = self._bars.get(event.stage)
        if bar is None:
            bar = tqdm(total=event.total, desc=event.stage, unit=event.unit, disable=self._disable,
                       leave=event.stage.count("-") == 0, dynamic_ncols=True)
            self._bars[event.stage] = bar
        if event.total is not None and bar.total != event.total:
            bar.reset(total=event.total)
        bar.n = event.done
        postfix = " ".join(p for p in (event.item, event.message) if p)
        if postfix:
            bar.set_postfix_str(postfix, refresh=False)
        bar.refresh()
        if event.total is not None and event.done >= event.total and event.stage.count("-"):
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
