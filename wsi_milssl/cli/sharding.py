"""``--shard I/N`` for the slide stages (``tile``, ``label``, ``heatmap``): a helper of the subcommand
modules, with the exit code of a shard whose slides failed (:func:`failed_exit`)."""

from __future__ import annotations

import argparse
import os
import sys

from wsi_milssl.distributed import parse_shard, slide_shard
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
        help=f"take every N-th of the {items} from the I-th (0-based), e.g. a SLURM array task: --shard "
             f"$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; the N shards may run at once into one --out and "
             f"together leave what one run leaves; give every shard the same {items.split(' ')[0]} (a shard whose "
             f"list differs from its run's earlier shards' is refused). Under torchrun: rank/world size")


def shard_from_args(args: argparse.Namespace) -> tuple[int, int]:
    """(I, N) from ``--shard``, else torchrun's rank and world size, else (0, 1). ConfigError for a
    bad torchrun environment."""
    return slide_shard(getattr(args, "shard", None))


def failed_exit(args: argparse.Namespace, shard: tuple[int, int], n_failed: int, *, out_dir: str | os.PathLike,
                status_csv: str | os.PathLike, what: str = "slide(s) failed") -> int:
    """The exit code of a slide stage's run (or shard ``shard``): 0, or 1 when ``n_failed`` items failed
    (``what`` says how), after a line to stderr saying how many and where their errors are (``status_csv``).

    A torchrun rank (no ``--shard``, world size > 1) with failed items first waits until the other ranks
    have finished their slides (:func:`wsi_milssl.locks.wait_for_other_shards`): torchrun ends every
    rank as soon as one exits non-zero, which would leave their slides half done. Separate processes
    (``--shard I/N``, a job array) exit at once."""
    if not n_failed:
        return 0
    if getattr(args, "shard", None) is None and shard[1] > 1:
        from wsi_milssl.locks import wait_for_other_shards

        wait_for_other_shards(out_dir, shard)
    part = f" (shard {shard[0]}/{shard[1]})" if shard[1] > 1 else ""
    print(f"error: {n_failed} {what}{part}; see {status_csv}", file=sys.stderr)
    return 1
