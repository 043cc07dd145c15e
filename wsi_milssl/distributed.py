"""Several processes on one job: ranks of a torchrun group (training), shards of a slide list (slide stages).

Training under ``torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT] -m wsi_milssl train
...`` joins the group torchrun describes in its environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
with :func:`init_group`: NCCL when the processes run on GPUs (rank ``LOCAL_RANK`` of a node takes GPU
``LOCAL_RANK``), gloo on CPUs. Without torchrun (or with one process) nothing is initialised and
:data:`SINGLE` describes the one process, so world size 1 runs exactly the single-process code.

Slide stages (``tile``, ``label``, ``heatmap``) split their slides instead (:func:`shard_items`):
shard ``I`` of ``N`` (a :class:`Shard`) comes from ``--shard I/N`` (0-based; for job arrays such as
SLURM ``--array``, whose tasks may start hours apart) or, without ``--shard`` under torchrun, from the
rank and world size (:func:`slide_shard`; both at once are refused). Shards given by ``--shard`` take
the slides whose name hashes to ``I`` (:func:`shard_of`), so a slide's shard does not depend on the
list it is in; torchrun's ranks, started together on one list, take every ``N``-th slide from the
``I``-th (equal shares), and meet at the end (:func:`wait_for_ranks`) so that none exits before the
others have finished. How a shard splits depends only on where it came from (:attr:`Shard.by`), never
on the environment of the process that splits.

The collectives used by training are here too, each a no-op for one process: :func:`gather_values`
(every rank's values at its indices -> the whole vector on every rank), :func:`all_sum`,
:func:`barrier`.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, NamedTuple, NoReturn, Sequence, TypeVar

import numpy as np

from wsi_milssl.errors import ConfigError, DistributedError, WsiMilsslError

__all__ = [
    "DistContext",
    "SINGLE",
    "torchrun_env",
    "is_main_rank",
    "local_world_size",
    "reported_by_rank0",
    "init_group",
    "close_group",
    "exit_now",
    "Shard",
    "parse_shard",
    "slide_shard",
    "shard_of",
    "shard_items",
    "wait_for_ranks",
    "rank_share",
    "split_evenly",
    "gather_values",
    "all_sum",
    "barrier",
]

T = TypeVar("T")

#: How long a rank waits in a collective for the others before it gives up (a rank died or hangs).
TIMEOUT = datetime.timedelta(minutes=30)
#: How long a slide stage's rank waits at the end for the other ranks (:func:`wait_for_ranks`): ranks
#: that tile or predict their own slides can finish hours apart (CAMELYON16 on a few GPUs).
RANKS_APART = datetime.timedelta(days=7)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in its group: ``rank`` of ``world_size`` (``local_rank`` on its node)
    and the ``backend`` ('nccl', 'gloo'; None for one process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints, metrics, plots and reports progress."""
        return self.rank == 0

    def describe(self) -> dict:
        return {"world_size": self.world_size, "backend": self.backend or "none"}


SINGLE = DistContext()


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None when not launched by it."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ConfigError(f"RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not "
                          "integers. Fix: launch with torchrun, which sets them, or unset them.") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world}). Fix: launch with torchrun.")
    return rank, world, local


def refuse_ranks_that_cannot_meet(rank: int, world: int) -> None:
    """ConfigError when RANK and WORLD_SIZE (``world`` > 1) were not set by torchrun (no ``TORCHELASTIC_RUN_ID``)
    and MASTER_ADDR / MASTER_PORT are missing: the ranks could not meet, so a slide stage would do this rank's
    share of the slides and then fail at its end, and training would fail with torch's traceback (review BJ: a
    launcher's or an outer job's variables left in the environment)."""
    if world <= 1 or os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} are set, but not by torchrun, and "
                          f"{' and '.join(missing)} {verb} not: the {world} processes could not meet, and this "
                          f"one would do its 1/{world} of the work alone. Fix: launch with torchrun, set MASTER_ADDR "
                          "and MASTER_PORT for ranks started by hand, or unset RANK and WORLD_SIZE (left by another "
                          "launcher or an outer job) to run one process.")


def is_main_rank() -> bool:
    """Whether this process reports what concerns the whole run (the same on every rank: a warning about
    the inputs, a setup error): True without torchrun, for ``--shard I/N`` processes (each its own
    command) and for torchrun's rank 0; False for torchrun's other ranks. :attr:`DistContext.is_main`
    where a group is joined; this needs none (a malformed RANK counts as rank 0: it is refused elsewhere)."""
    try:
        env = torchrun_env()
    except ConfigError:
        return True
    return env is None or env[0] == 0


def local_world_size() -> int:
    """How many ranks of this job run on this machine: torchrun's ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``),
    1 without it (one process, a ``--shard`` process, ranks started by hand) or when it is not a positive
    integer. The ranks of a node share its CPUs, so automatic reader counts are divided by it."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@contextmanager
def reported_by_rank0(*, wait_s: float, warnings: bool = True,
                      own_errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """A block whose messages concern the whole run, the same on every rank (reading and checking the
    inputs, setting up the output folder), so that torchrun's rank 0 alone reports them: on the other ranks
    (:func:`is_main_rank`) its warnings are not logged (``warnings`` True; False where the block also logs
    this rank's own, e.g. of its slides), and a WsiMilsslError raised in it (not a DistributedError, which is
    this rank's own) first waits up to ``wait_s`` seconds for torchrun's agent (``TORCHELASTIC_RUN_ID``) to
    end this rank, which it does as soon as rank 0 exits after reporting the same error; an error that rank
    0 did not have is raised (and printed) after the wait. The rank still exits non-zero. ``own_errors``: errors
    of this rank alone (a patch only it reads, its reader process lost), raised at once. Elsewhere (one
    process, rank 0, a ``--shard`` process) the block runs as it is."""
    if is_main_rank():
        yield
        return
    previous = logging.root.manager.disable
    if warnings:
        logging.disable(max(previous, logging.WARNING))
    try:
        yield
    except (DistributedError, *own_errors):
        raise
    except WsiMilsslError:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            time.sleep(wait_s)  # torchrun ends this rank here when rank 0 stopped on the same error
        raise
    finally:
        logging.disable(previous)


def init_group(device: str = "auto", *, timeout: datetime.timedelta = TIMEOUT) -> DistContext:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs) and return this process's place in it;
    :data:`SINGLE` without torchrun or with one process. ``device``: the training device setting
    ('auto', 'cpu', 'cuda'); with CUDA each rank takes GPU ``LOCAL_RANK``. ``timeout``: how long a
    collective waits for the other ranks."""
    env = torchrun_env()
    if env is None or env[1] == 1:
        return SINGLE
    refuse_ranks_that_cannot_meet(env[0], env[1])
    import torch
    import torch.distributed as dist

    rank, world, local = env
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        if local >= torch.cuda.device_count():
            raise ConfigError(f"rank {rank}: LOCAL_RANK {local} but this node has {torch.cuda.device_count()} GPU(s). "
                              "Fix: --nproc-per-node at most the GPUs of a node.")
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    return DistContext(rank=rank, world_size=world, local_rank=local, backend=backend)


def close_group(ctx: DistContext, *, finished: bool = False) -> None:
    """Leave the process group (after the last collective; again, or without a group, it does nothing).

    ``finished``: this rank got through its work without an error, and every rank is to end now. It
    first waits for the others (a barrier), so that no rank exits while another still works (rank 0
    writing the last epoch's files: torchrun ends every rank as soon as one exits non-zero); a rank
    lost in that barrier is a DistributedError. After an error (``finished`` False) the ranks leave at
    once: the others may be in another collective. Garbage is collected before the group is destroyed:
    DistributedDataParallel's reducer, held in a reference cycle, kept the gloo group alive until the
    interpreter exited, where destroying it sometimes aborted the process ("terminate called without an
    active exception", SIGABRT)."""
    if not ctx.enabled:
        return
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if finished:
        try:
            dist.barrier()
        except RuntimeError as exc:
            dist.destroy_process_group()
            raise DistributedError(f"rank {ctx.rank}: lost the other ranks at the end, after this rank's work was "
                                   f"done ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). Fix: "
                                   "find why the other rank stopped (its log).") from None
    gc.collect()
    dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """End this process with exit status ``code`` at once, after flushing stdout, stderr and the logs,
    without the interpreter's shutdown (``os._exit``): how the ranks of a training run other than rank 0
    leave after :func:`close_group` (``finished=True``). Their shutdown ran the destructors of torch's
    distributed objects, which sometimes abort the process (SIGABRT, exit -6), and torchrun then
    reports a finished run as failed."""
    import logging
    import sys

    logging.shutdown()  # flushes and closes every handler (the console, --log-file)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a closed pipe: nothing more can be written there
            pass
    os._exit(code)


# ----------------------------------------------------------------------------------------------
# Shards of a list (slide stages)
# ----------------------------------------------------------------------------------------------

def parse_shard(text: str) -> tuple[int, int]:
    """``'I/N'`` (0-based shard I of N) -> (I, N); ConfigError naming the value otherwise."""
    try:
        index, count = (int(v) for v in str(text).split("/"))
    except ValueError:
        raise ConfigError(f"--shard {text!r} is not I/N; give the 0-based shard and the count, e.g. --shard 0/4 "
                          "(SLURM: --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT).") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"--shard {text!r}: the shard must be 0..{max(count, 1) - 1} of {count} (0-based), and the "
                          "count at least 1.")
    return index, count


class Shard(NamedTuple):
    """Shard ``index`` of ``count`` of a slide stage's items, and how the items are split (``by``):
    'hash' for ``--shard I/N`` (separate processes, :func:`shard_of`), 'position' for torchrun's ranks
    (every ``count``-th item from the ``index``-th). A plain pair (I, N) splits by hash."""

    index: int = 0
    count: int = 1
    by: Literal["hash", "position"] = "hash"


def slide_shard(shard: str | None) -> Shard:
    """This process's shard of a slide stage: ``--shard I/N`` when given (split by hash), else
    torchrun's rank of its world size (split by position), else 0 of 1. ``--shard`` under torchrun
    with several ranks is refused (ConfigError): the two would split the slides differently."""
    env = torchrun_env()
    if shard is not None:
        if env is not None and env[1] > 1:
            raise ConfigError(f"--shard {shard} under torchrun (RANK={env[0]}, WORLD_SIZE={env[1]}): torchrun's "
                              "ranks already split the slides, and --shard would split them another way. Fix: "
                              "drop --shard under torchrun, or run --shard I/N without torchrun (unset RANK and "
                              "WORLD_SIZE).")
        return Shard(*parse_shard(shard), by="hash")
    if env is not None:
        refuse_ranks_that_cannot_meet(env[0], env[1])
        return Shard(env[0], env[1], by="position")
    return Shard()


def shard_of(name: str, count: int) -> int:
    """The shard (0..``count``-1) of the item called ``name`` among ``count`` separate shards: its name's
    SHA-256 modulo ``count``, the same in every process, on every list and in every stage."""
    # (a name of another encoding, a surrogate escape, hashes by its escaped text: review FA, a traceback)
    return int(hashlib.sha256(name.encode("utf-8", "backslashreplace")).hexdigest(), 16) % count


def shard_items(items: Sequence[T], index: int, count: int, by: Literal["hash", "position"] = "hash", *,
                name: Callable[[T], str]) -> list[T]:
    """Shard ``index`` of ``count``'s items (all shards together hold each item once), in list order;
    ``shard_items(items, *shard, name=...)`` with a :class:`Shard` or a pair (I, N).

    ``by='hash'``: separate processes (``--shard I/N``: array tasks, which may start hours apart on a
    list that changed in between) take the items whose ``name(item)`` (the slide's stem) hashes to
    ``index`` (:func:`shard_of`): an item's shard does not depend on the other items, so shards given
    different lists never do one item twice, and every item that all of them saw is done. An item added
    after its shard ran is left for the next run (as after an unsharded run). The shares are about
    equal for many items.

    ``by='position'``: torchrun's ranks, which start together on one list, take every ``count``-th item
    from the ``index``-th instead: equal shares of similar mix.
    """
    if by not in ("hash", "position"):
        raise ConfigError(f"shard_items: by={by!r} is not 'hash' or 'position'.")
    if count <= 1:
        return list(items)
    if by == "position":
        global _SPLIT_LIST
        names = [name(item) for item in items]
        _SPLIT_LIST = (len(names), hashlib.sha256("\n".join(names).encode("utf-8")).hexdigest(), names[:1], names[-1:])
        return list(items[index::count])
    return [item for item in items if shard_of(name(item), count) == index]


#: (count, SHA-256 of the names, [first name], [last name]) of the list the last split by position (torchrun's
#: ranks) took its share of: :func:`wait_for_ranks` compares the ranks' lists
_SPLIT_LIST: tuple[int, str, list[str], list[str]] | None = None


def wait_for_ranks() -> None:
    """Under torchrun with several ranks, return when every rank has got here: a gloo barrier (on the
    CPU) that waits up to :data:`RANKS_APART`. A slide stage's ranks call it at the end, before a rank
    with failed slides exits 1: torchrun ends every rank as soon as one exits non-zero, which would
    stop the others mid-slide. Then DistributedError on every rank when the ranks split different lists of
    slides (:func:`shard_items` by position; review CI: a slide folder still being copied into, listed a moment
    apart, left slides done by no rank, or by two, with exit status 0). Without torchrun (or with one rank) it
    returns at once, without importing torch."""
    ctx = init_group("cpu", timeout=RANKS_APART)
    try:
        barrier(ctx)
        if ctx.enabled:
            import torch.distributed as dist

            lists: list = [None] * ctx.world_size
            dist.all_gather_object(lists, _SPLIT_LIST)
            if len({None if lst is None else lst[:2] for lst in lists}) > 1:
                counts = ", ".join(f"rank {r}: " + ("?" if lst is None else f"{lst[0]} ({', '.join(lst[2] + lst[3])})")
                                   for r, lst in enumerate(lists))
                raise DistributedError(
                    f"the ranks split different lists of slides ({counts}: the number of slides, the first and "
                    "the last): a slide folder that changed while they listed it (slides still being copied in), "
                    "or one that the machines, or the slide lists they were given, name differently; some slides "
                    "may have been done by no rank, or by two. Fix: give every rank the same slides, and run the "
                    "same command again once the folder no longer changes (finished slides are kept).")
    finally:
        close_group(ctx)


# ----------------------------------------------------------------------------------------------
# Shares of an epoch (training)
# ----------------------------------------------------------------------------------------------

def rank_share(order, *, batch_size: int, ctx: DistContext):
    """This rank's instances of a global epoch ``order`` (int64 tensor), so that the ranks' steps
    together are the steps of one process with batch ``batch_size x world_size``: each global batch is
    cut into ``world_size`` consecutive pieces of ``batch_size`` (consecutive, so shuffle blocks stay
    whole), and rank r takes piece r. A last, smaller global batch is split evenly when it has at
    least one instance per rank and dropped otherwise (every rank must take the same number of steps);
    the order changes every epoch, so no instance is left out for long. A tail that does not divide by the
    ranks is split into pieces one apart (9: 5 and 4), and each rank's loss is its piece's mean, so that one
    step weighs its instances slightly unequally (review BJ: weights 1.9e-4 from one process after an epoch,
    against 1.3e-5 for an even tail)."""
    if not ctx.enabled:
        return order
    import torch

    world, b = ctx.world_size, batch_size
    n = int(order.numel())
    full = n // (b * world) * (b * world)
    main = order[:full].reshape(-1, world, b)[:, ctx.rank].reshape(-1)
    tail = order[full:]
    if tail.numel() >= world:
        return torch.cat([main, torch.tensor_split(tail, world)[ctx.rank]])
    return main


def split_evenly(indices: np.ndarray, ctx: DistContext) -> np.ndarray:
    """This rank's consecutive piece of ``indices`` (for predictions: every rank reads runs of a store)."""
    if not ctx.enabled:
        return indices
    return np.array_split(np.asarray(indices), ctx.world_size)[ctx.rank]


def gather_values(values, positions, *, size: int, ctx: DistContext):
    """Every rank's float ``values`` at int ``positions`` (numpy or CPU tensors) -> the float32 numpy
    vector of length ``size`` on every rank (positions no rank gave stay NaN)."""
    values = np.asarray(values, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.int64)
    out = np.full(size, np.nan, dtype=np.float32)
    if not ctx.enabled:
        out[positions] = values
        return out
    import torch.distributed as dist

    parts: list = [None] * ctx.world_size
    dist.all_gather_object(parts, (positions, values))
    for pos, val in parts:
        out[pos] = val
    return out


def all_sum(*values: float, ctx: DistContext) -> tuple[float, ...]:
    """The sums over ranks of each of ``values`` (float64)."""
    if not ctx.enabled:
        return tuple(float(v) for v in values)
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if ctx.backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return tuple(float(v) for v in t.cpu())


def barrier(ctx: DistContext) -> None:
    """Wait until every rank gets here."""
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()
