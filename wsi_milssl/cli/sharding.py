"""``--shard I/N`` for the slide stages (``tile``, ``label``, ``heatmap``): a helper of the subcommand
modules, with the exit code of a run or shard (:func:`failed_exit`; under torchrun, once every rank has
finished)."""

from __future__ import annotations

import argparse
import os

from wsi_milssl.distributed import Shard, parse_shard, slide_shard, wait_for_ranks
from wsi_milssl.errors import ConfigError

__all__ = ["add_shard_argument", "failed_exit", "shard_from_args"]


def _shard_text(text: str) -> str:
    """argparse type: the ``I/N`` text, checked (a bad value is a usage error: exit 2 with the usage)."""
    try:
        parse_shard(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_shard_argument(parser: argparse.ArgumentParser, *, items: str) -> None:
    """Add ``--shard I/N``; ``items``: what is split ('slides', 'stores')."""
    parser.add_argument(
        "--shard", type=_shard_text, default=None, metavar="I/N",
        help=f"take shard I of N of the {items} (0-based), e.g. a SLURM array task: --shard "
             f"$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; the N shards may run at once into one --out and "
             f"together leave what one run leaves. A slide's shard is fixed by a hash of its name, not by its "
             f"place in the list: shards given different lists (a slide added between two array tasks) never "
             f"do a slide twice and do every slide that all of them saw; a slide added after its shard ran is "
             f"done by the next run. Under torchrun leave it out: rank/world size (every N-th slide from the I-th)")


def shard_from_args(args: argparse.Namespace) -> Shard:
    """The shard from ``--shard`` (split by hash), else torchrun's rank and world size (split by
    position), else 0 of 1. ConfigError for a bad torchrun environment, or ``--shard`` under torchrun
    with several ranks."""
    return slide_shard(getattr(args, "shard", None))


def failed_exit(args: argparse.Namespace, shard: Shard, n_failed: int, *,
                status_csv: str | os.PathLike, what: str = "slide(s) failed") -> int:
    """The exit code of a slide stage's run (or shard ``shard``): 0, or 1 when ``n_failed`` items failed
    (``what`` says how), after an ``error:`` line to stderr and the log file saying how many and where their
    errors are (``status_csv``).

    Under torchrun (no ``--shard``) every rank first waits until all ranks have got here
    (:func:`wsi_milssl.distributed.wait_for_ranks`): torchrun ends every rank as soon as one exits
    non-zero, which would leave their slides half done. Separate processes (``--shard I/N``, a job
    array) and unsharded runs exit at once, without importing torch."""
    if isinstance(shard, Shard) and shard.by == "position" and shard.count > 1:
        wait_for_ranks()
    if not n_failed:
        return 0
    part = f" (shard {shard[0]}/{shard[1]})" if shard[1] > 1 else ""
    from wsi_milssl.cli import report_error

    return report_error(f"{n_failed} {what}{part}; see {status_csv}", code=1)
