"""Training on several ranks (torchrun): the checks that keep the ranks together. Every rank is refused at the
start when the ranks were given different settings or data, or too few instances to share; after each epoch the
ranks' statistics and online probabilities are combined and their weights compared; a lost rank becomes one error
naming the epoch and how to continue. With one process every function here does nothing."""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import shlex
import torch

from wsi_milssl.config.base import config_to_dict
from wsi_milssl.config.train import RUNTIME_ONLY_FIELDS, TrainConfig
from wsi_milssl.distributed import DistContext, all_sum, gather_values
from wsi_milssl.errors import ConfigError, DistributedError
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.mil.loader import normalises_batches
from wsi_milssl.mil.models import core_module
from wsi_milssl.mil.run_folder import data_digest

if TYPE_CHECKING:
    from wsi_milssl.mil.selftrain import PseudoLabelState

__all__: list[str] = []  # the mil package's own: fit calls them

log = logging.getLogger(__name__)


def _broadcast_buffers(model: torch.nn.Module, dist: DistContext) -> None:
    """Rank 0's buffers (BatchNorm running statistics) on every rank: DistributedDataParallel sends
    them before each forward, so after the last step the ranks differ by their own last update."""
    import torch.distributed as tdist

    for buffer in core_module(model).buffers():
        tdist.broadcast(buffer, src=0)


def _combine_ranks(stats: dict[str, float], state: PseudoLabelState, order: torch.Tensor,
                   dist: DistContext, model: torch.nn.Module) -> dict[str, float]:
    """The epoch over all ranks: summed loss, steps of one rank (they take the same number), every
    instance seen; rank 0's buffers on every rank; the probabilities each rank recorded for its
    share, gathered into every rank's ``state.online_probs`` (instances no rank saw keep theirs)."""
    loss_sum, seen = all_sum(stats["loss"] * stats["instances"], stats["instances"], ctx=dist)
    _broadcast_buffers(model, dist)
    mine = order.numpy()
    gathered = gather_values(state.online_probs.numpy()[mine], mine, size=len(state.online_probs), ctx=dist)
    update = torch.from_numpy(gathered)
    keep = torch.isnan(update)
    state.online_probs.copy_(torch.where(keep, state.online_probs, update))
    return {"loss": loss_sum / max(seen, 1.0), "steps": stats["steps"], "instances": int(seen),
            "refresh_seconds": stats["refresh_seconds"]}


def _ranks_agree(model: torch.nn.Module, state: PseudoLabelState, dist: DistContext) -> bool:
    """Whether every rank holds the same weights, buffers and pseudo labels (a digest per rank,
    gathered); DistributedError when they do not, which would mean the ranks diverged."""
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    h.update(state.targets.numpy().tobytes())
    digests = [None] * dist.world_size
    import torch.distributed as tdist

    tdist.all_gather_object(digests, h.hexdigest())
    if len(set(digests)) != 1:
        raise DistributedError(f"rank {dist.rank}: the {dist.world_size} ranks hold different weights or pseudo labels "
                               f"after an epoch ({', '.join(d[:8] for d in digests)}). Fix: this is a bug; report it "
                               "with the run's config.json, and train with one process meanwhile.")
    return True


def _same_inputs(config: TrainConfig, train: InstanceSet, val: InstanceSet | None, *, resume: bool,
                 eval_at: Sequence[int] | None, dist: DistContext, digests: dict[str, str | None] | None = None) -> None:
    """Refuse on every rank, with one error naming what differs, when the ranks were not given the same
    settings and data (torchrun runs one command on every rank, but each node of a multi-node run is
    started by hand): different labels or epochs made the ranks fail later with raw tracebacks or lost
    peers. Runtime-only settings (threads, workers, device, ...) may differ."""
    if not dist.enabled:
        return
    settings = {k: v for k, v in config_to_dict(config).items() if k not in RUNTIME_ONLY_FIELDS}
    settings.update(resume=resume, eval_at=None if eval_at is None else sorted(int(e) for e in eval_at))
    if config.weights_path and Path(config.weights_path).is_file():  # the file, however each node spells it
        from wsi_milssl.hashing import cached_file_sha256

        settings["weights_path"] = f"weights of SHA-256 {cached_file_sha256(Path(config.weights_path))[:12]}"

    if digests is None:
        digests = {"data_digest": data_digest(train), "val_data_digest": None if val is None else data_digest(val)}

    def data(s: InstanceSet | None, digest: str | None) -> str | None:
        return None if s is None else (f"{s.n_bags} bags ({int((s.bag_labels == 1).sum())} positive), {len(s)} "
                                       f"instances, digest {digest}")

    mine = {**{k: json.dumps(v, sort_keys=True, default=str) for k, v in settings.items()},
            "training data": data(train, digests["data_digest"]),
            "validation data": data(val, digests["val_data_digest"])}
    every: list = [None] * dist.world_size
    import torch.distributed as tdist

    tdist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every[1:], start=1):
        diffs = [f"{k} {theirs.get(k)} vs {v}" for k, v in every[0].items() if theirs.get(k) != v]
        if diffs:
            # every rank finds it: an error of the whole run (not a DistributedError, a rank's own), which torchrun's
            # rank 0 alone prints (review DA: once per rank, "rank 0: rank 1's ...")
            raise ConfigError(
                f"rank {rank}'s settings or data differ from rank 0's: {'; '.join(diffs[:4])}. "
                "Fix: give every rank the same command (the same inputs, labels, validation set and settings).")


def _lost_peer(exc: RuntimeError, dist: DistContext, epoch: int | None, out: Path | None,
               when: str | None = None) -> BaseException:
    """A failed collective (a rank died or was killed): one clear error naming the epoch (None: before
    the first), or ``when`` it happened, and how to continue; other RuntimeErrors pass as they are."""
    if not dist.enabled:
        return exc
    text = str(exc)
    markers = ("connection", "peer", "gloo", "nccl", "timed out", "timeout", "broken pipe", "closed", "socket")
    if not any(m in text.lower() for m in markers):
        return exc
    if when is None:
        when = "before training started" if epoch is None else f"during epoch {epoch + 1}"
    check = "find why the other rank stopped (its log)"
    if out is not None and (out / "last.pt").is_file():
        then = (f"; {out} keeps the checkpoint of the last finished epoch. Fix: {check}, then continue with "
                f"`torchrun ... wsi-milssl train --resume {shlex.quote(str(out))}` (any number of processes; the global batch is "
                "--batch-size x processes).")
    elif out is not None:
        then = f"; no epoch was saved. Fix: {check}, then start the run again with the same command (the same --out)."
    else:
        then = "."
    return DistributedError(f"rank {dist.rank}: lost the other ranks {when} ({text.splitlines()[0]}){then}")


@contextmanager
def _peer_guard(dist: DistContext, epoch: int | None, out: Path | None, when: str | None = None):
    """Around collectives: a lost rank becomes :func:`_lost_peer`'s one error."""
    try:
        yield
    except RuntimeError as exc:
        error = _lost_peer(exc, dist, epoch, out, when)
        if error is exc:
            raise
        raise error from None


def _warn_other_world_size(path: Path, ckpt: dict[str, Any], config: TrainConfig, dist: DistContext,
                           start_epoch: int) -> None:
    """On resume: warn when the run continues on another number of ranks than the one that saved ``path``
    (its config's "distributed" world size): the global batch is ``batch_size x world size``, so the
    steps of an epoch change from here on (each epoch's world size is in metrics.jsonl)."""
    saved = (ckpt.get("config") or {}).get("distributed") or {}
    before = saved.get("world_size") if isinstance(saved, dict) else None
    if not isinstance(before, int) or isinstance(before, bool) or before < 1 or before == dist.world_size:
        return
    b = config.batch_size
    log.warning("%s: epochs up to %d ran on %d rank(s) with a global batch of %d (--batch-size %d x %d), this resume "
                "runs on %d with a global batch of %d, so the steps per epoch change from epoch %d on. Fix: to keep "
                "the global batch, resume with %d rank(s) (torchrun: nodes x --nproc-per-node).", path, start_epoch,
                before, b * before, b, before, dist.world_size, b * dist.world_size, start_epoch + 1, before)


def _check_shareable(train: InstanceSet, model: torch.nn.Module, dist: DistContext) -> None:
    """Refuse (ConfigError, on every rank) a training set too small to give every rank a step: with fewer
    instances than ranks (than twice the ranks for models with BatchNorm, which never train on a batch
    of one: :func:`without_lone_last`) every epoch's last global batch is all there is and is dropped
    (:func:`~wsi_milssl.distributed.rank_share`), so no rank would take a step and every epoch would
    report a loss of 0."""
    if not dist.enabled:
        return
    per_rank = 2 if normalises_batches(model) else 1
    n, world = len(train), dist.world_size
    if n >= per_rank * world:
        return
    why = " (the model's BatchNorm layers cannot normalise a batch of one)" if per_rank == 2 else ""
    most = n // per_rank
    fix = (f"fewer ranks (at most {most}: torchrun's nodes x --nproc-per-node)" if most > 1
           else "train with one process (without torchrun)")
    raise ConfigError(f"{train.source}: {n} training instances cannot be shared by {world} ranks: each rank needs "
                      f"at least {per_rank} per step{why}, so no step would be taken. Fix: {fix}, or more training "
                      "instances.")


def _saved_by_rank0(dist: DistContext, epoch: int, out: Path | None, *, failed: bool) -> None:
    """After rank 0 wrote an epoch's files (``failed``: it could not), every rank learns whether it did (a
    collective of every rank; nothing with one process): the other ranks stop with rank 0 instead of
    going on to the next epoch, where they would only find rank 0 gone and name that epoch. After the
    last epoch it is also what keeps every rank until rank 0's files are complete."""
    if not dist.enabled:
        return
    with _peer_guard(dist, epoch, out, when=f"while rank 0 saved epoch {epoch + 1}"):
        (failures,) = all_sum(1.0 if failed and dist.is_main else 0.0, ctx=dist)
    if failures and not dist.is_main:
        where = f"the run folder {out}" if out is not None else "the run folder"
        raise DistributedError(f"rank {dist.rank}: stopped with rank 0, which could not write {where} after epoch "
                               f"{epoch + 1}; rank 0's error says why and how to continue.")
