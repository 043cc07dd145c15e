"""``--shard I/N`` for the slide stages (``tile``, ``label``): a helper of the subcommand modules."""

from __future__ import annotations

import argparse

from wsi_milssl.distributed import parse_shard, slide_shard
from wsi_milssl.errors import ConfigError

__all__ = ["add_shard_argument", "shard_from_args"]


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
             f"together leave what one run leaves. Under torchrun: rank/world size")


def shard_from_args(args: argparse.Namespace) -> tuple[int, int]:
    """(I, N) from ``--shard``, else torchrun's rank and world size, else (0, 1). ConfigError for a
    bad torchrun environment."""
    return slide_shard(getattr(args, "shard", None))
