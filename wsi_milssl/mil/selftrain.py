"""MIL-SSL weakly-supervised self-training (paper section 2.4, eq. 2-11).

Every instance of a negative bag is a labelled negative. The instances of positive bags are unlabelled;
at each refresh they get pseudo labels from :func:`wsi_milssl.mil.sinkhorn.assign_pseudo_labels` applied
to the current model's probabilities, with the scheduled ratio μ_t (eq. 10). The classifier is trained
with soft cross-entropy (eq. 9) on randomly mixed batches drawn from all instances.

Public pieces with explicit arguments: :func:`predict_probs`, :func:`refresh_pseudo_labels`,
:func:`train_one_epoch`, :func:`evaluate` and :func:`fit` (the whole run: checkpoints, metrics,
plots, resume).

Reproducibility: the instance order, the augmentation and the global torch generator (dropout) are
re-seeded at every epoch from ``(seed, epoch)``, and the pseudo labels are part of the checkpoint, so a
run resumed from ``last.pt`` continues exactly as an uninterrupted run (bit-identical weights on CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shlex
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from wsi_milssl import __version__
from wsi_milssl.atomic import atomic_write_text, remove_quietly
from wsi_milssl import runtime as runtime_rules
from wsi_milssl.config.base import config_to_dict
from wsi_milssl.config.train import TrainConfig
from wsi_milssl.distributed import SINGLE, DistContext, gather_values, rank_share, split_evenly
from wsi_milssl.errors import (CheckpointError, ConfigError, OutputError, ReaderLostError, StoreError,
                               TrainingDivergedError, WsiMilsslError)
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.locks import folder_lock
from wsi_milssl.paths import folder_place
from wsi_milssl.mil.checkpoint import RESUME_FIX, capture_rng, interrupt_after, restore_rng, save_checkpoint
from wsi_milssl.mil.data import NORMALISATION, InstanceSet, held_out_bags, reopened_stores_warning
from wsi_milssl.mil.loader import BatchLoader, block_order, normalises_batches, without_lone_last
from wsi_milssl.mil.models import core_module, create_model, is_image_model
from wsi_milssl.mil.pixels import prepare_patches
# fit's helpers, called through this module's names (tests replace some of them here)
from wsi_milssl.mil.ranks import (_check_shareable, _combine_ranks, _peer_guard, _ranks_agree, _same_inputs,
                                  _saved_by_rank0, _warn_other_world_size)
from wsi_milssl.mil.run_folder import (PLOT_INTERVAL_S, _check_best, _clear_earlier_run, _data_fingerprint,
                                       _draw_metrics, _json_default, _read_history, _resume_checkpoint, _save_failed,
                                       _write_metrics, best_checkpoint, data_digest, existing_run_error, plot_behind)
from wsi_milssl.mil.scores import _check_selectable, auc_or_none, bag_metrics, bag_scores, selection_score
from wsi_milssl.mil.sinkhorn import adaptive_mu, assign_pseudo_labels

__all__ = [
    "Runtime",
    "resolve_runtime",
    "PseudoLabelState",
    "FitResult",
    "predict_probs",
    "refresh_pseudo_labels",
    "pseudo_label_metrics",
    "train_one_epoch",
    "evaluate",
    "fit",
    "build_model",
    "make_optimizer",
    "weights_finite",
]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Runtime: device, precision, workers
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Runtime:
    """Where and how tensors are computed: ``device``, autocast dtype (None = full precision), whether a
    float16 gradient scaler is needed, channels_last for image models, reader processes, and where
    stored JPEG patches are decoded (``decode``: 'workers' or 'device')."""

    device: torch.device
    amp_dtype: torch.dtype | None
    use_grad_scaler: bool
    channels_last: bool
    num_workers: int
    decode: str = "workers"

    def autocast(self):
        return runtime_rules.autocast(self.device, self.amp_dtype)

    def describe(self) -> str:
        return runtime_rules.describe(self.device, self.amp_dtype, channels_last=self.channels_last,
                                      workers=self.num_workers, decode=self.decode)


def resolve_runtime(config: TrainConfig) -> Runtime:
    """Pick the device, precision and worker count for ``config`` on this machine (rules in
    :mod:`wsi_milssl.runtime`; on the CPU 'auto' precision is bf16 for image models, float32 for heads)."""
    device = runtime_rules.pick_device(config.device, owner="TrainConfig")
    image = is_image_model(config.model)
    dtype = runtime_rules.pick_amp_dtype(config.amp, device, cpu_auto="bf16" if image else "off")
    scaler = dtype is torch.float16 and device.type == "cuda"
    workers = config.num_workers
    if workers < 0:
        # On a GPU the readers must keep up with the train step (7,400 patches/s at 224 px on an H100,
        # one process decodes ~2,400), so most cores read. On the CPU the model uses every core: with 2
        # cores JPEG decoding in-process (~3,000 patches/s) is not the bottleneck and a reader process
        # only competes with the model, so none there.
        # Under torchrun the ranks of a machine share its cores: each takes its share of the count.
        cpus = os.cpu_count() or 1
        if not image:
            workers = 0
        elif device.type == "cuda":
            workers = runtime_rules.readers_per_rank(max(1, min(16, cpus - 2)), minimum=1)
        else:
            workers = runtime_rules.readers_per_rank(min(4, cpus - 1) if cpus > 2 else 0, minimum=0)
    return Runtime(device=device, amp_dtype=dtype, use_grad_scaler=scaler,
                   channels_last=bool(config.channels_last and image), num_workers=workers,
                   decode=config.decode if image else "workers")


def _seed_for(seed: int, *stream: int) -> int:
    """A 63-bit seed derived from ``seed`` and stream numbers (epoch, purpose)."""
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, dtype=np.uint64)[0]) >> 1


def _generator(seed: int, *stream: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(_seed_for(seed, *stream))
    return g


# ----------------------------------------------------------------------------------------------
# Model, inputs, predictions
# ----------------------------------------------------------------------------------------------

def _model_kwargs(config: TrainConfig, instances: InstanceSet) -> dict[str, Any]:
    if is_image_model(config.model):
        return {"num_classes": 2}
    kwargs: dict[str, Any] = {"num_classes": 2, "in_features": instances.in_features}
    if config.model == "mlp":
        kwargs.update(hidden_dims=list(config.hidden_dims), dropout=float(config.dropout))
    return kwargs


def build_model(config: TrainConfig, instances: InstanceSet) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Create ``config.model`` for ``instances`` (feature heads standardise with their statistics).

    Returns the model (on the CPU, in train mode) and the keyword arguments that rebuild it.
    """
    kwargs = _model_kwargs(config, instances)
    model = create_model(config.model, weights_path=config.weights_path, **kwargs)
    if instances.kind == "features" and hasattr(model, "standardize"):
        model.standardize.set_stats(torch.from_numpy(instances.features))
    return model, kwargs


def _prepare_inputs(raw: torch.Tensor, runtime: Runtime, *, kind: str,
                    aug_generator: torch.Generator | None = None, config: TrainConfig | None = None
                    ) -> torch.Tensor:
    """The model input of a batch already on the device: features as they are; uint8 pixels normalised
    (and augmented with ``aug_generator`` when ``config.augment``) by :func:`prepare_patches`."""
    if kind == "features":
        return raw
    augment = aug_generator is not None and config is not None and config.augment
    x = prepare_patches(raw, generator=aug_generator if augment else None,
                        colour_jitter=config.colour_jitter if augment else 0.0)
    return x if runtime.channels_last else x.contiguous()


def _loader_for(loader: BatchLoader | None, instances: InstanceSet, runtime: Runtime) -> BatchLoader:
    """``loader``, or a one-pass loader of ``instances`` (closed by the caller when it is not ``loader``)."""
    if loader is not None:
        return loader
    return BatchLoader([instances], num_workers=runtime.num_workers, device=runtime.device, decode=runtime.decode)


@torch.no_grad()
def predict_probs(model: torch.nn.Module, instances: InstanceSet, indices: np.ndarray | None = None, *,
                  runtime: Runtime, batch_size: int = 512, loader: BatchLoader | None = None,
                  progress: ProgressCallback | None = None, stage: str = "predict",
                  dist: DistContext = SINGLE) -> np.ndarray:
    """Positive-class probabilities (eq. 2), float32 (len(indices),), eval mode, no augmentation.

    Batches come from ``loader`` (the run's readers) or a one-pass loader; the probabilities stay on
    the device until the pass ends, so the GPU never waits for the host. With several ranks
    (``dist``) each predicts a consecutive piece of ``indices`` and every rank gets all of them.
    """
    idx = np.arange(len(instances)) if indices is None else np.asarray(indices, dtype=np.int64)
    if dist.enabled:
        mine = split_evenly(np.arange(idx.size), dist)
        local = predict_probs(model, instances, idx[mine], runtime=runtime, batch_size=batch_size, loader=loader,
                              progress=progress, stage=stage)
        return gather_values(local, mine, size=idx.size, ctx=dist)
    if idx.size == 0:
        return np.empty(0, dtype=np.float32)
    was_training = model.training
    model.eval()
    source = _loader_for(loader, instances, runtime)
    parts: list[torch.Tensor] = []
    done = 0
    try:
        with torch.inference_mode():
            for bidx, raw in source.batches(instances, idx, batch_size=batch_size):
                x = _prepare_inputs(raw, runtime, kind=instances.kind)
                with runtime.autocast():
                    logits = model(x)
                parts.append(torch.softmax(logits.float(), dim=1)[:, 1])
                done += bidx.numel()
                emit(progress, ProgressEvent(stage=stage, done=done, total=int(idx.size), unit="inst"))
    finally:
        model.train(was_training)
        if source is not loader:
            source.close()
    return torch.cat(parts).cpu().numpy().astype(np.float32, copy=False)


# ----------------------------------------------------------------------------------------------
# Pseudo labels
# ----------------------------------------------------------------------------------------------

@dataclass
class PseudoLabelState:
    """Training targets and the pseudo-label bookkeeping.

    ``targets`` float32 (N,): 0 for negative-bag instances, the pseudo label for positive-bag ones.
    ``pos_index`` int64 (Np,): the positive-bag instances. ``online_probs`` float32 (N,): the last
    probability seen in a training pass (NaN when unseen), used by ``online_pseudo_labels``.
    ``mu_t``: the ratio used at the last refresh; ``refreshes``: how many refreshes ran.
    """

    targets: torch.Tensor
    pos_index: torch.Tensor
    online_probs: torch.Tensor
    mu_t: float = float("nan")
    refreshes: int = 0

    @classmethod
    def initial(cls, instances: InstanceSet) -> "PseudoLabelState":
        n = len(instances)
        pos = np.flatnonzero(instances.instance_bag_labels == 1)
        return cls(targets=torch.zeros(n, dtype=torch.float32), pos_index=torch.from_numpy(pos.astype(np.int64)),
                   online_probs=torch.full((n,), float("nan"), dtype=torch.float32))

    def to_dict(self) -> dict[str, Any]:
        return {"targets": self.targets.clone(), "pos_index": self.pos_index.clone(),
                "online_probs": self.online_probs.clone(), "mu_t": float(self.mu_t),
                "refreshes": int(self.refreshes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PseudoLabelState":
        return cls(targets=data["targets"].float().clone(), pos_index=data["pos_index"].long().clone(),
                   online_probs=data["online_probs"].float().clone(), mu_t=float(data["mu_t"]),
                   refreshes=int(data["refreshes"]))


def refresh_pseudo_labels(model: torch.nn.Module, instances: InstanceSet, state: PseudoLabelState, *,
                          mu_t: float, config: TrainConfig, runtime: Runtime,
                          loader: BatchLoader | None = None, progress: ProgressCallback | None = None,
                          dist: DistContext = SINGLE) -> None:
    """Recompute the pseudo labels of the positive-bag instances in place (``state.targets``).

    Probabilities come from an eval-mode pass without augmentation, or, with
    ``config.online_pseudo_labels``, from the probabilities recorded during training when every
    positive-bag instance has one (with several ranks only at epoch ends, where the ranks' records are
    merged: refreshes inside an epoch predict).

    Raises (:func:`_non_finite_scores_error`) when some probability is NaN or infinite (a diverged model):
    pseudo labels cannot be assigned from them.
    """
    pos = state.pos_index.numpy()
    if pos.size == 0:
        return
    probs = None
    # several ranks: between epochs the ranks' online probabilities are merged (_combine_ranks); in the
    # middle of an epoch (refresh_every) each rank holds only its own share, so predict instead
    if config.online_pseudo_labels and not (dist.enabled and config.refresh_every > 0):
        seen = state.online_probs[state.pos_index]
        if not torch.isnan(seen).any():
            probs = seen.numpy().astype(np.float64)
    if probs is None:
        probs = predict_probs(core_module(model), instances, pos, runtime=runtime, batch_size=config.eval_batch_size,
                              loader=loader, progress=progress, stage="train-refresh", dist=dist)
    bad = ~np.isfinite(probs)
    if bad.any():
        raise _non_finite_scores_error(model, instances, np.unique(instances.bag_ids[pos][bad]), runtime=runtime,
                                       refresh_bags=np.unique(instances.bag_ids[pos]).size)
    q = assign_pseudo_labels(probs, instances.bag_ids[pos], mu=mu_t, lam=config.lam,
                             soft=config.soft_labels, local_constraint=config.local_constraint,
                             global_constraint=config.global_constraint,
                             max_iter=config.sinkhorn_max_iter, tol=config.sinkhorn_tol)
    state.targets[state.pos_index] = torch.from_numpy(q)
    state.mu_t = float(mu_t)
    state.refreshes += 1


def pseudo_label_metrics(state: PseudoLabelState, instances: InstanceSet) -> dict[str, float | None]:
    """Mean pseudo label and, when instance labels exist (evaluation only), the precision, recall and
    accuracy of the binarised (> 0.5) pseudo labels of positive-bag instances (paper figure 8)."""
    pos = state.pos_index.numpy()
    q = state.targets.numpy()[pos]
    out: dict[str, float | None] = {
        "pseudo_label_mean": float(q.mean()) if q.size else None,
        "pseudo_positive_fraction": float((q > 0.5).mean()) if q.size else None,
        "pseudo_precision": None, "pseudo_recall": None, "pseudo_accuracy": None,
    }
    if instances.instance_labels is not None and q.size:
        y = instances.instance_labels[pos].astype(bool)
        hard = q > 0.5
        out["pseudo_accuracy"] = float((hard == y).mean())
        out["pseudo_precision"] = float(y[hard].mean()) if hard.any() else None
        out["pseudo_recall"] = float(hard[y].mean()) if y.any() else None
    return out


# ----------------------------------------------------------------------------------------------
# One epoch of training
# ----------------------------------------------------------------------------------------------

def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                       negative_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of (B, 2) logits against soft positive targets (B,) in [0, 1] (eq. 9); the
    negative term of each instance is scaled by ``negative_weights`` (B,) when given
    (``TrainConfig.pseudo_negative_weight``)."""
    logp = F.log_softmax(logits.float(), dim=1)
    negative = (1.0 - targets) * logp[:, 0]
    if negative_weights is not None:
        negative = negative_weights * negative
    return -(targets * logp[:, 1] + negative).mean()


def negative_weights(instances: InstanceSet, config: TrainConfig) -> torch.Tensor | None:
    """(N,) weight of each instance's negative loss term: ``config.pseudo_negative_weight`` for the
    instances of positive bags, 1 for those of negative bags (known negatives); None when every weight is
    1 (the paper's loss)."""
    if config.pseudo_negative_weight == 1.0:
        return None
    weights = np.where(instances.instance_bag_labels == 1, config.pseudo_negative_weight, 1.0)
    return torch.from_numpy(weights.astype(np.float32))


#: Seconds between progress events that carry the running loss (reading it waits for the device).
LOSS_REPORT_S = 2.0


def train_one_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, instances: InstanceSet,
                    state: PseudoLabelState, *, order: torch.Tensor, config: TrainConfig, runtime: Runtime,
                    aug_generator: torch.Generator | None, step: int = 0, mu_t: float = 0.5,
                    scaler: torch.amp.GradScaler | None = None, loader: BatchLoader | None = None,
                    progress: ProgressCallback | None = None, dist: DistContext = SINGLE,
                    refresh: bool = True, refresh_first: bool = False) -> dict[str, float]:
    """One pass over ``order`` (a permutation of all instance indices) in batches of ``config.batch_size``
    (a last batch of one instance is left out for models with BatchNorm: :func:`without_lone_last`).

    Refreshes the pseudo labels every ``config.refresh_every`` steps (counted globally from ``step``)
    when that is > 0 and ``refresh`` (False during warm-up epochs), and before the first step with
    ``refresh_first`` (the first epoch after the warm-up: its labels are not kept past it). Records training probabilities into ``state.online_probs``. Returns
    ``{"loss": mean loss, "steps": steps taken, "instances": instances seen}`` (of this rank: ``order``
    is this rank's share when several ranks train, and ``model`` their DistributedDataParallel wrapper),
and ``"refresh_seconds"``: the time spent refreshing pseudo labels within the pass (not training).

    The loop never waits for the device: targets, the running loss and the probabilities of the pass
    live on the device and are read back once at the end (and with the loss in a progress event at
    most every :data:`LOSS_REPORT_S` seconds).
    """
    model.train()
    if not dist.enabled and normalises_batches(model):  # (several ranks: fit decides on the global order)
        order = without_lone_last(order, batch_size=config.batch_size)
    dev = runtime.device
    source = _loader_for(loader, instances, runtime)
    targets = state.targets.to(dev)
    neg_weights = negative_weights(instances, config)
    if neg_weights is not None:
        neg_weights = neg_weights.to(dev)
    online = state.online_probs.to(dev)
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)
    steps, seen, refresh_s = 0, 0, 0.0
    n = int(order.numel())
    message, last_report = "", time.perf_counter()
    try:
        for bidx, raw in source.batches(instances, order, batch_size=config.batch_size):
            if refresh and config.refresh_every > 0 and ((step + steps) % config.refresh_every == 0
                                                         or (refresh_first and steps == 0)):
                t_ref = time.perf_counter()
                state.online_probs.copy_(online.cpu())
                refresh_pseudo_labels(model, instances, state, mu_t=mu_t, config=config, runtime=runtime,
                                      loader=source, dist=dist)
                targets = state.targets.to(dev)
                model.train()
                refresh_s += time.perf_counter() - t_ref
            x = _prepare_inputs(raw, runtime, kind=instances.kind, aug_generator=aug_generator, config=config)
            bidx_dev = bidx.to(dev, non_blocking=True)
            if config.compile == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are done with
            with runtime.autocast():
                logits = model(x)
            loss = soft_cross_entropy(logits, targets[bidx_dev],
                                      None if neg_weights is None else neg_weights[bidx_dev])
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                online[bidx_dev] = torch.softmax(logits.detach().float(), dim=1)[:, 1]
                total_loss += loss.detach().double() * bidx.numel()
            steps += 1
            seen += int(bidx.numel())
            if progress is not None and (seen == n or time.perf_counter() - last_report >= LOSS_REPORT_S):
                message, last_report = f"loss {float(total_loss) / seen:.4f}", time.perf_counter()
            emit(progress, ProgressEvent(stage="train-epoch", done=seen, total=n, unit="inst", message=message))
    finally:
        if source is not loader:
            source.close()
    state.online_probs.copy_(online.cpu())
    return {"loss": float(total_loss) / max(seen, 1), "steps": steps, "instances": seen, "refresh_seconds": refresh_s}


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------


def evaluate(model: torch.nn.Module, instances: InstanceSet, *, runtime: Runtime, bag_pooling: str = "max",
             batch_size: int = 512, threshold: float = 0.5, loader: BatchLoader | None = None,
             progress: ProgressCallback | None = None, dist: DistContext = SINGLE) -> dict[str, Any]:
    """Instance and bag metrics of ``model`` on ``instances`` (eval mode, no augmentation).

    Returns a dict with ``instance_auc`` (None without instance labels or with one class), ``bag_auc``,
    ``bag_accuracy`` (bag score > ``threshold``), ``bag_nll`` (mean binary cross-entropy of the bag
    scores) and the arrays ``probs`` float32 (N,) and ``bag_scores`` float64 (n_bags,).

    Raises (:func:`_non_finite_scores_error`) when some probability is NaN or infinite: metrics of the bags
    with finite scores would stand for the whole set (and choose best.pt) without a word.
    """
    probs = predict_probs(core_module(model), instances, runtime=runtime, batch_size=batch_size, loader=loader,
                          progress=progress, stage="train-eval", dist=dist)
    bad = np.unique(instances.bag_ids[~np.isfinite(probs)])
    if bad.size:
        raise _non_finite_scores_error(model, instances, bad, runtime=runtime)
    scores = bag_scores(probs, instances.bag_ids, instances.n_bags, pooling=bag_pooling)
    return {
        "instance_auc": None if instances.instance_labels is None
        else auc_or_none(instances.instance_labels.astype(np.int64), probs.astype(np.float64)),
        **bag_metrics(scores, instances.bag_labels, threshold=threshold),
        "probs": probs,
        "bag_scores": scores,
    }


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter and floating-point buffer (BatchNorm statistics) of ``model`` is finite."""
    tensors = [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _non_finite_scores_error(model: torch.nn.Module, instances: InstanceSet, bags: np.ndarray, *,
                            runtime: Runtime, refresh_bags: int | None = None) -> WsiMilsslError:
    """The error for the bags ``bags`` of ``instances`` whose probabilities are NaN or infinite, naming them
    (with their store, feature file or slide where known); ``refresh_bags``: the number of (positive) bags
    predicted at a pseudo-label refresh, when the probabilities were a refresh's, not an evaluation's. Its cause decides its kind: weights that hold
    NaN or infinity are a diverged run (TrainingDivergedError, fix: the learning rate); a finite model is
    driven out of range by the inputs of those bags (StoreError, fix: those inputs, or the mixed precision)."""
    where = (instances.store_paths if instances.store_paths is not None else instances.bag_sources
             or [""] * instances.n_bags)
    shown = ", ".join(instances.bag_names[b] + (f" ({where[b]})" if where[b] else "") for b in bags[:5].tolist())
    shown += f" and {bags.size - 5} more" if bags.size > 5 else ""
    of = "" if any(where) else f" of {instances.source}"
    if refresh_bags is None:
        head = (f"the model gives NaN or infinite probabilities for {bags.size} of the {instances.n_bags} bags "
                f"evaluated{of}: {shown}, so their scores, and the AUC, accuracy and loss of the set, are undefined "
                "(they are not computed over the other bags)")
    else:
        head = (f"the model gives NaN or infinite probabilities for {bags.size} of the {refresh_bags} positive "
                f"training bags{of} at a pseudo-label refresh: {shown}, so their pseudo labels are undefined")
    if not weights_finite(core_module(model)):
        return TrainingDivergedError(f"{head}: the model's weights hold NaN or infinity (a diverged run). Fix: lower "
                                     "the learning rate (--lr), e.g. by 10x, and train again.")
    amp = runtime.amp_dtype is not None
    return StoreError(
        f"{head}. The model's weights are finite, so the inputs of those bags are the cause: values extreme enough "
        "to overflow it (features far beyond the others')"
        f"{f', or an overflow under mixed precision ({runtime.amp_dtype})' if amp else ''}. Fix: check those bags' "
        "inputs for extreme values and make them again (or leave those bags out)"
        f"{'; or run without mixed precision (--amp off)' if amp else ''}.")


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------

@dataclass
class FitResult:
    """What :func:`fit` returns: the trained model (eval mode) with the LAST epoch's weights, the per-epoch
    metric records, the best epoch on validation (None without validation), the run folder and, when asked
    for, the validation bag scores at each evaluated epoch ``{epoch: float64 (n_bags,)}``. The model chosen
    on validation is ``out_dir/best.pt``: :func:`wsi_milssl.inference.load_inference_model` (or the heatmap
    stage given the run folder) reads it."""

    model: torch.nn.Module
    history: list[dict[str, Any]]
    best_epoch: int | None
    out_dir: Path | None
    val_bag_scores: dict[int, np.ndarray] = field(default_factory=dict)
    val_probs: dict[int, np.ndarray] = field(default_factory=dict)


def _checkpoint_config(config: TrainConfig, instances: InstanceSet, runtime: Runtime,
                       model_kwargs: dict[str, Any]) -> dict[str, Any]:
    cfg = config_to_dict(config)
    settings = dict(instances.settings)
    # the stores' tile recipe, unchanged (None for stores written before it was recorded): the heatmap
    # stage cuts slides with it
    tiling_plan = settings.pop("tiling_plan", None)
    cfg.update({
        "tiling_plan": tiling_plan,
        "target_mpp": settings.get("target_mpp"),
        "target_magnification": settings.get("target_magnification"),
        "patch_size_px": settings.get("patch_size_px"),
        "entropy_threshold_bits": settings.get("entropy_threshold_bits"),
        "store_settings": settings,
        "normalisation": {k: list(v) for k, v in NORMALISATION.items()} if instances.kind == "images" else None,
        "in_features": instances.in_features,
        "model_name": config.model,
        "model_kwargs": model_kwargs,
        "train_bags": list(instances.bag_names),
        "train_instances": len(instances),
        "data_fingerprint": _data_fingerprint(instances),
        "runtime": runtime.describe(),
        "package_version": __version__,
    })
    return cfg


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``config`` (sgd with momentum, adam, adamw) over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def _compiled(trainer: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``trainer`` through ``torch.compile`` in ``mode`` ('default' or 'reduce-overhead'). Shapes are
    static: a pass has full batches and at most one smaller last batch (two graphs). Graphs of earlier
    fits in this process are dropped first: each model is a new guard on the same ``forward``, and after
    torch's recompile limit (8) later fits (a grid's points) would silently run eager."""
    torch._dynamo.reset()
    return torch.compile(trainer, mode=None if mode == "default" else mode, dynamic=False)


@contextmanager
def _reader_guard(out: Path | None):
    """A reader process that died (:class:`ReaderLostError`) is reported with how to continue the run."""
    try:
        yield
    except ReaderLostError as exc:
        fix = "train with fewer --workers (each reader holds its items in memory) or with more memory"
        if out is not None and (out / "last.pt").is_file():
            then = (f"; {out} keeps the checkpoint of the last finished epoch. Fix: {fix}, then continue with "
                    f"`wsi-milssl train --resume {shlex.quote(str(out))}` (under torchrun: `torchrun ... wsi-milssl "
                    f"train --resume {shlex.quote(str(out))}`).")
        elif out is not None:
            then = f"; no epoch was saved. Fix: {fix}, then start the run again with the same command."
        else:
            then = f". Fix: {fix}."
        raise ReaderLostError(f"{exc}{then}") from None


@contextmanager
def _compile_errors(config: TrainConfig):
    """A failure of ``torch.compile`` itself (no C++ compiler, no Triton) as one ConfigError naming the fix."""
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as exc:
        if config.compile == "off":
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"TrainConfig.compile {config.compile!r}: torch.compile could not compile the training "
                          f"step ({type(exc).__name__}: {first}). Fix: --compile off (compilation needs a working "
                          "C++ compiler, and Triton on a GPU).") from exc


def _check_finite(model: torch.nn.Module, loss: float | None, *, amp: bool, epoch: int, out: Path | None,
                  autocast_dtype: torch.dtype | None = None) -> None:
    """Raise :class:`TrainingDivergedError` when the epoch left non-finite weights or BatchNorm statistics (a
    forward pass that overflows updates them even when the gradient scaler skips its step), or (without mixed
    precision, whose scaler skips steps with overflowing gradients on its own) a non-finite loss; called
    before the epoch's checkpoint, so ``last.pt`` keeps the last finite epoch. ``autocast_dtype`` (the
    run's mixed precision, if any) adds ``--amp off`` to the fix when the weights broke under a finite
    loss: bfloat16 has no scaler to skip a step with non-finite gradients. ``loss`` None: the epoch stopped
    at a pseudo-label refresh inside it (``refresh_every``), before its loss was known."""
    weights_ok = weights_finite(model)
    if weights_ok and (amp or loss is None or math.isfinite(loss)):
        return
    kept = (f" {out / 'last.pt'} still holds epoch {epoch} (the last finite one)." if epoch and out is not None
            else " No checkpoint was written.")
    what = "weights" if not weights_ok else "loss"
    fix = "lower the learning rate (--lr), e.g. by 10x, and train again."
    if not weights_ok and loss is not None and math.isfinite(loss) and autocast_dtype is torch.bfloat16:
        fix = ("the loss stayed finite, so one step's gradients were non-finite under bfloat16 mixed precision: "
               "train again without it (--amp off), or lower the learning rate (--lr), e.g. by 10x.")
    when = "found at a pseudo-label refresh inside the epoch" if loss is None else f"loss {loss}"
    raise TrainingDivergedError(f"training diverged in epoch {epoch + 1}: the {what} became non-finite ({when})."
                                f"{kept} Fix: {fix}")


@runtime_rules.restores_torch_settings
def fit(train: InstanceSet, *, config: TrainConfig, out_dir: str | os.PathLike | None = None,
        val: InstanceSet | None = None, resume: bool = False, eval_at: Sequence[int] | None = None,
        keep_val_scores: bool = False, run_info: dict[str, Any] | None = None,
        progress: ProgressCallback | None = None, dist: DistContext = SINGLE) -> FitResult:
    """Train an instance classifier with MIL-SSL.

    Parameters
    ----------
    train : the training instances (negative and positive bags).
    config : the resolved training settings; ``config.mode`` must match ``train.kind``.
    out_dir : run folder for ``config.json``, ``last.pt``, ``best.pt`` (with ``val``), ``metrics.jsonl``
        and ``metrics.png``; None keeps everything in memory (used by the benchmark).
    val : validation instances; selects ``best.pt`` by ``config.select_metric`` (never a test set).
    resume : continue from ``out_dir/last.pt`` (same settings required; more epochs allowed when the
        learning rate is constant).
    eval_at : completed-epoch counts (1-based) at which to evaluate ``val``; default every epoch.
    keep_val_scores : keep the validation bag scores and instance probabilities of every evaluation.
    run_info : extra JSON-ready entries for the saved config (the CLI records its inputs under "data").
    progress : callback receiving ProgressEvents ("train" per epoch, "train-epoch" per batch).
    dist : this process's place in a torchrun group (:func:`wsi_milssl.distributed.init_group`).
        With several ranks the model trains under DistributedDataParallel: the ranks together take
        the steps of one process with batch ``batch_size x world_size`` (BatchNorm normalises each
        rank's batch, and its running statistics are rank 0's, as DistributedDataParallel keeps them);
        refresh and validation predictions are split between the ranks and gathered, so every rank
        holds the same pseudo labels; rank 0 alone writes the run folder; at the start the ranks check
        that they were given the same settings and data, after every epoch that they hold the same
        weights and pseudo labels, and after rank 0's saves whether it could write them (the other ranks
        stop with it, naming that epoch); a rank lost in a collective is one DistributedError; fewer
        training instances than ranks (than twice the ranks for BatchNorm models) are refused.

    A fresh run (not ``resume``) into an ``out_dir`` that holds a run's ``last.pt`` raises ConfigError
    (:func:`existing_run_error`) rather than delete that run. The run holds the lock of ``out_dir`` (a second
    run into it raises FolderLockedError, and temporaries left there by a killed run are removed). A run folder that cannot be written (full
    disk, read-only) raises one OutputError naming the folder and the fix.
    Returns a :class:`FitResult`; ``config`` must be a :class:`~wsi_milssl.config.TrainConfig` (ConfigError otherwise).
    """
    if not isinstance(config, TrainConfig):  # a dict from a notebook: name the type to build
        raise ConfigError(f"fit: config must be a wsi_milssl.config.TrainConfig (TrainConfig(**settings) from a "
                          f"dict); got {type(config).__name__}.")
    kwargs = dict(config=config, out_dir=out_dir, val=val, resume=resume, eval_at=eval_at,
                  keep_val_scores=keep_val_scores, run_info=run_info, progress=progress, dist=dist)
    if out_dir is not None and not resume and (Path(out_dir) / "last.pt").exists():
        raise existing_run_error(Path(out_dir))
    with _callers_random_state():
        if out_dir is None or not dist.is_main:  # the other ranks never write the run folder
            return _fit(train, **kwargs)
        with folder_lock(out_dir, named_by=None if resume else "--out"):  # --resume continues this folder
            return _fit(train, **kwargs)


@contextmanager
def _callers_random_state() -> Iterator[None]:
    """The run seeds torch's, numpy's and Python's global random streams from its own seed; give the caller
    (a notebook drawing a split after training) its streams back as they were (review BX: every later draw
    repeated the run's). CUDA streams are kept when CUDA is in use already."""
    np_state, py_state = np.random.get_state(), random.getstate()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


def _shared_bags(train: InstanceSet, val: InstanceSet) -> list[str]:
    """Validation bags that are also training bags (those :func:`~wsi_milssl.mil.data.held_out_bags` does
    not hold out)."""
    held_out = set(held_out_bags(train, val))
    return sorted(n for n in val.bag_names if n not in held_out)


def _warn_online_labels_predicted(config: TrainConfig, dist: DistContext) -> None:
    """Rank 0 warns that online pseudo labels are predicted inside epochs on several ranks (review BJ: the run
    differed from one process without a word; :func:`refresh_pseudo_labels`)."""
    if dist.is_main and dist.enabled and config.online_pseudo_labels and config.refresh_every > 0:
        log.warning("online_pseudo_labels with refresh_every %d on %d ranks: the refreshes inside an epoch predict "
                    "the positive-bag instances (each rank holds only its share of the online probabilities), so "
                    "this run differs from one process with the same settings. Fix, to match one process: "
                    "refresh_every 0 (a refresh per epoch takes the merged online probabilities), or train in one "
                    "process.", config.refresh_every, dist.world_size)


def _warn_mu_not_reached(config: TrainConfig, *, resume: bool = False) -> None:
    """Warn when warm-up covers every epoch (no pseudo label is ever computed); else when the adaptive schedule (paper eq. 10: μ_t = μ from epoch T on, epochs counted from 0, warm-up
    epochs included) never reaches μ: T >= the number of epochs, so the last epoch trains at a μ_t above μ.
    The fix names the options and their pipeline settings; a resume (whose T and fixed_mu are the run's own)
    can only train more epochs."""
    if config.warmup_epochs >= config.epochs > 0:
        log.warning("warmup_epochs %d is not below epochs %d: every epoch is a warm-up epoch (every instance of a "
                    "positive bag trained as positive), so no pseudo label is ever computed and MIL-SSL never "
                    "runs (review BR). Fix: warmup_epochs below epochs (default 0, the paper's), or more epochs (in "
                    "a pipeline: train.warmup_epochs, train.epochs).", config.warmup_epochs, config.epochs)
        return
    if config.fixed_mu or config.mu_ramp_epochs <= 0 or config.mu_ramp_epochs < config.epochs:
        return
    last = adaptive_mu(config.epochs - 1, mu=config.mu, ramp_epochs=config.mu_ramp_epochs)
    if resume:
        fix = (f"resume with --epochs {config.mu_ramp_epochs + 1} or more (T and --fixed-mu are the run's own "
               "settings, which a resume keeps; in a pipeline: train.epochs, train.mu_ramp_epochs or train.fixed_mu, "
               "which train a new run)")
    else:
        ramp = f"{config.epochs - 1} or less" if config.epochs > 1 else "0 (no ramp)"
        fix = (f"--mu-ramp-epochs {ramp} (μ in the last epoch), more --epochs, or --fixed-mu (in a pipeline: "
               "train.mu_ramp_epochs, train.epochs, train.fixed_mu)")
    log.warning("the μ schedule never reaches μ = %g: it goes from 0.5 over mu_ramp_epochs (--mu-ramp-epochs) T = %d "
                "epochs (paper eq. 10, warm-up epochs included) and reaches μ at epoch %d, but the run trains %d "
                "epoch(s), the last at μ_t = %.4f. Fix: %s.", config.mu, config.mu_ramp_epochs,
                config.mu_ramp_epochs + 1, config.epochs, last, fix)


def _check_training_sets(train: InstanceSet, val: InstanceSet | None, config: TrainConfig, dist: DistContext) -> None:
    """ConfigError for training and validation sets that do not fit the settings or each other, or a training set
    without bags of both labels; a warning for validation bags that are also training bags."""
    if train.kind != config.mode:
        raise ConfigError(f"training instances are {train.kind!r} but TrainConfig.mode is {config.mode!r}. Fix: "
                          f"TrainConfig(mode={train.kind!r}, ...)"
                          + (", with model 'linear' or 'mlp'." if train.kind == "features" else "."))
    if val is not None and val.kind != train.kind:
        raise ConfigError(f"validation instances are {val.kind!r} but training instances are {train.kind!r}.")
    if val is not None and train.kind == "features" and val.in_features != train.in_features:
        raise ConfigError(f"validation features have length {val.in_features}, training {train.in_features}.")
    shared = _shared_bags(train, val) if val is not None else []
    if shared and dist.is_main:
        log.warning("%d of the %d validation bags are also training bags (%s%s): best.pt and the validation "
                    "metrics then come from data the model trains on. Fix: validate on bags held out from "
                    "training.", len(shared), val.n_bags, ", ".join(shared[:5]), ", ..." if len(shared) > 5 else "")
    bag_labels = train.bag_labels
    if not (bag_labels == 0).any():
        raise ConfigError(f"{train.source}: no negative bag among the {train.n_bags} training bags; MIL-SSL "
                          "learns negatives from negative bags, so add slides labelled 0.")
    if not (bag_labels == 1).any():
        raise ConfigError(f"{train.source}: no positive bag among the {train.n_bags} training bags; add slides "
                          "labelled 1.")


def _restore_run(ckpt: dict[str, Any], out: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, scaler: Any, train: InstanceSet, config: TrainConfig, dist: DistContext
                 ) -> tuple[int, int, PseudoLabelState, tuple[float, float] | None, int | None, list[dict[str, Any]]]:
    """Load the run that ``last.pt`` (``ckpt``) holds into ``model``, the optimizer, scheduler and grad scaler
    and the random streams; returns (epoch, step, pseudo-label state, best score, best epoch, metrics
    history). CheckpointError naming the fix when it cannot be restored."""
    best_score: tuple[float, float] | None = None
    best_epoch: int | None = None
    start_epoch, step = int(ckpt["epoch"]), int(ckpt["step"])
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if scheduler is not None and ckpt.get("scheduler") is not None:
            scheduler.load_state_dict(ckpt["scheduler"])
        if scaler is not None and ckpt.get("grad_scaler") is not None:
            scaler.load_state_dict(ckpt["grad_scaler"])
        state = PseudoLabelState.from_dict(ckpt["pseudo_labels"])
        if state.targets.numel() != len(train) or state.online_probs.numel() != len(train):
            raise ValueError(f"its pseudo labels are of {state.targets.numel()} instances, the training set has "
                             f"{len(train)}")
        restore_rng(ckpt["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
        detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
        raise CheckpointError(f"{out / 'last.pt'}: cannot restore the run from it ({detail[:300]}). "
                              f"{RESUME_FIX}") from None
    if not weights_finite(model):  # e.g. NaN BatchNorm statistics saved by an earlier version
        raise CheckpointError(f"{out / 'last.pt'}: holds non-finite weights (NaN or infinity: a diverged run), "
                              "so the run cannot be resumed from it. Fix: train again into a new --out (in "
                              "`wsi-milssl run`: --force train), e.g. with a lower learning rate (--lr).")
    best = ckpt.get("best") or {}
    if best.get("score") is not None:
        best_score = tuple(best["score"])
        best_epoch = best.get("epoch")
    history = _read_history(out, before_epoch=start_epoch)
    if (not history or int(history[-1].get("epoch", 0)) < start_epoch) and ckpt.get("metrics"):
        history.append(dict(ckpt["metrics"]))  # killed before metrics.jsonl got last.pt's epoch (older runs)
    if dist.is_main:
        _check_best(out, ckpt, best_epoch)
        _warn_other_world_size(out / "last.pt", ckpt, config, dist, start_epoch)
        if config.plots and plot_behind(out):
            _draw_metrics(out, history)
    log.info("resumed %s at epoch %d (step %d)", out / "last.pt", start_epoch, step)
    return start_epoch, step, state, best_score, best_epoch, history


def _save_epoch(out: Path, ckpt: dict[str, Any], history: list[dict[str, Any]], *, improved: bool,
                draw: bool) -> OutputError | None:
    """Write an epoch's ``best.pt`` (when ``improved``), ``metrics.jsonl`` and ``last.pt`` (``ckpt``), then
    ``metrics.png`` (when ``draw``); returns the error to raise once the ranks know (None when saved)."""
    saved = ckpt["epoch"] - 1  # the epoch last.pt holds until this save succeeds
    try:
        # last.pt last: it is what a resume starts from, so a kill between these writes re-runs
        # this epoch, which writes best.pt and its metrics record again. Ctrl-C waits for the three
        # (well under a second), and the plot comes after them (review BN: a Ctrl-C during the plot,
        # drawn between them, lost the epoch)
        with interrupt_after():
            if improved:
                save_checkpoint(best_checkpoint(ckpt), out / "best.pt")
            _write_metrics(out, history)
            save_checkpoint(ckpt, out / "last.pt")
        saved = ckpt["epoch"]
        if draw:
            _draw_metrics(out, history)
    except OutputError as exc:
        if saved == 0:  # no epoch saved: nothing written for this one may look like a run
            for name in ("best.pt", "metrics.jsonl", "metrics.png"):
                remove_quietly(out / name)
        return _save_failed(out, exc, saved_epoch=saved)
    return None


def _fit(train: InstanceSet, *, config: TrainConfig, out_dir: str | os.PathLike | None,
         val: InstanceSet | None, resume: bool, eval_at: Sequence[int] | None, keep_val_scores: bool,
         run_info: dict[str, Any] | None, progress: ProgressCallback | None, dist: DistContext) -> FitResult:
    digests = None  # compared on resume and between ranks; a run in memory (the benchmark) needs none
    if out_dir is not None or dist.enabled:
        digests = {"data_digest": data_digest(train),
                   "val_data_digest": None if val is None else data_digest(
                       val, instance_labels=config.select_metric == "instance_auc")}
    with _peer_guard(dist, None, None):  # first, before any rank can stop on its own inputs
        _same_inputs(config, train, val, resume=resume, eval_at=eval_at, dist=dist, digests=digests)
    _check_training_sets(train, val, config, dist)
    if resume and out_dir is None:
        raise ConfigError("resume needs the run folder (out_dir) that holds last.pt.")
    bag_labels = train.bag_labels
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    runtime = resolve_runtime(config)
    if runtime.device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    model_kwargs = _model_kwargs(config, train)
    ckpt_config = _checkpoint_config(config, train, runtime, model_kwargs)
    ckpt_config.update(digests or {})
    ckpt_config["distributed"] = dist.describe()
    ckpt_config.update(run_info or {})
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and isinstance(ckpt_config.get("data"), dict) and "run_dir" not in ckpt_config["data"]:
        # where the run folder was (the pipeline's runs; `wsi-milssl train` records it itself): `train --resume` of a
        # run moved together with its inputs reads them where they are now (cli/train.py)
        ckpt_config["data"] = {**ckpt_config["data"], "run_dir": str(folder_place(out))}
    # a resume compares the data and settings with the saved run first: a change there is the cause to name
    ckpt = _resume_checkpoint(out, ckpt_config, config) if resume and out is not None else None
    if val is not None and out is not None:
        _check_selectable(val, config)
    log.info("training %s on %s (%d instances in %d bags, %d positive bags)", config.model,
             runtime.describe(), len(train), train.n_bags, int((bag_labels == 1).sum()))

    torch.manual_seed(_seed_for(config.seed, 0, 0))
    np.random.seed(_seed_for(config.seed, 0, 1) % (2**32))
    random.seed(_seed_for(config.seed, 0, 2))
    # a resume neither loads nor needs the initial weights: last.pt holds the whole model
    model, _ = build_model(replace(config, weights_path=None) if ckpt is not None else config, train)
    _check_shareable(train, model, dist)
    model.to(runtime.device)
    if runtime.channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(model, config)
    scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.epochs)
                 if config.scheduler == "cosine" else None)
    scaler = torch.amp.GradScaler("cuda") if runtime.use_grad_scaler else None
    state = PseudoLabelState.initial(train)

    start_epoch, step = 0, 0
    best_score: tuple[float, float] | None = None
    best_epoch: int | None = None
    history: list[dict[str, Any]] = []
    if ckpt is not None:
        start_epoch, step, state, best_score, best_epoch, history = _restore_run(
            ckpt, out, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, train=train,
            config=config, dist=dist)
    if out is not None and dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            _clear_earlier_run(out)
        atomic_write_text(out / "config.json", json.dumps(ckpt_config, indent=2, sort_keys=True,
                                                           default=_json_default) + "\n")
    # a benchmark grid (eval_at) chooses its epochs and T on purpose; a finished run read back (the pipeline finding
    # its run) trains nothing and was warned about when it trained
    if dist.is_main and eval_at is None and start_epoch < config.epochs:
        _warn_mu_not_reached(config, resume=resume)  # once the run is set up: a setup error comes alone
    _warn_online_labels_predicted(config, dist)
    if dist.is_main and train.kind == "images":
        slow = reopened_stores_warning(train.n_bags)
        if slow:
            log.warning("%s", slow)
    trainer = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        with _peer_guard(dist, start_epoch, out):
            trainer = DistributedDataParallel(model, device_ids=[dist.local_rank] if dist.backend == "nccl" else None)
    if config.compile != "off":
        trainer = _compiled(trainer, config.compile)

    eval_set = None if eval_at is None else {int(e) for e in eval_at}
    result = FitResult(model=model, history=history, best_epoch=best_epoch, out_dir=out)
    emit(progress, ProgressEvent(stage="train", done=start_epoch, total=config.epochs, unit="epoch"))
    last_plot = -math.inf

    # One pool of readers serves every pass of the run (training, refresh, validation; all epochs).
    with BatchLoader([train, val], num_workers=runtime.num_workers, device=runtime.device,
                     decode=runtime.decode) as loader, _reader_guard(out):
        for epoch in range(start_epoch, config.epochs):
            t0 = time.perf_counter()
            # Re-seed every random stream from (seed, epoch): a resumed run draws exactly the same numbers.
            # Ranks share the data order and differ in their augmentation and dropout streams.
            rank_stream = (dist.rank,) if dist.enabled else ()
            torch.manual_seed(_seed_for(config.seed, epoch, 3, *rank_stream))
            mu_t = adaptive_mu(epoch, mu=config.mu, ramp_epochs=config.mu_ramp_epochs, fixed=config.fixed_mu)
            refresh_s = 0.0
            warming = epoch < config.warmup_epochs
            if warming:
                # warm-up (before the first refresh): every positive-bag instance is a positive
                state.targets[state.pos_index] = 1.0
            elif config.refresh_every == 0:
                t_ref = time.perf_counter()
                with _peer_guard(dist, epoch, out):
                    refresh_pseudo_labels(model, train, state, mu_t=mu_t, config=config, runtime=runtime,
                                          loader=loader, progress=progress, dist=dist)
                refresh_s = time.perf_counter() - t_ref
            label_metrics = pseudo_label_metrics(state, train)
            order = block_order(train, _generator(config.seed, epoch, 1), block_size=config.shuffle_block)
            if normalises_batches(model):  # no rank gets a last batch of one instance (global, before the split)
                order = without_lone_last(order, batch_size=config.batch_size, world_size=dist.world_size)
            order = rank_share(order, batch_size=config.batch_size, ctx=dist)
            aug = _generator(config.seed, epoch, 2, *rank_stream) if train.kind == "images" else None
            try:
                with _peer_guard(dist, epoch, out), _compile_errors(config):
                    stats = train_one_epoch(trainer, optimizer, train, state, order=order, config=config,
                                            runtime=runtime, aug_generator=aug, step=step, mu_t=mu_t,
                                            scaler=scaler, loader=loader, progress=progress, dist=dist,
                                            refresh=not warming,
                                            refresh_first=epoch == config.warmup_epochs > 0)
                    if dist.enabled:
                        stats = _combine_ranks(stats, state, order, dist, trainer)
            except TrainingDivergedError:  # a refresh inside the epoch (refresh_every) met diverged weights
                _check_finite(model, None, amp=scaler is not None, epoch=epoch, out=out,
                              autocast_dtype=runtime.amp_dtype)
                raise
            _check_finite(model, stats["loss"], amp=scaler is not None, epoch=epoch, out=out,
                          autocast_dtype=runtime.amp_dtype)
            if config.refresh_every > 0:
                label_metrics = pseudo_label_metrics(state, train)
            step += stats["steps"]
            refresh_s += stats["refresh_seconds"]  # refreshes within the epoch (refresh_every > 0)
            lr = optimizer.param_groups[0]["lr"]
            if scheduler is not None:
                scheduler.step()
            train_s = time.perf_counter() - t0
            record: dict[str, Any] = {"epoch": epoch + 1, "step": step, "world_size": dist.world_size,
                                      "loss": stats["loss"], "mu_t": mu_t, "lr": lr, **label_metrics,
                                      "train_seconds": train_s, "refresh_seconds": refresh_s,
                                      "instances_per_second": stats["instances"] / max(train_s - refresh_s, 1e-9)}
            improved = False
            if val is not None and (eval_set is None or epoch + 1 in eval_set):
                t_val = time.perf_counter()
                with _peer_guard(dist, epoch, out):
                    metrics = evaluate(model, val, runtime=runtime, bag_pooling=config.bag_pooling,
                                       batch_size=config.eval_batch_size, loader=loader, dist=dist)
                if keep_val_scores:
                    result.val_bag_scores[epoch + 1] = metrics["bag_scores"]
                    result.val_probs[epoch + 1] = metrics["probs"]
                record.update({f"val_{k}": v for k, v in metrics.items() if k not in ("probs", "bag_scores")})
                record["val_seconds"] = time.perf_counter() - t_val
                score = selection_score(metrics, config.select_metric)
                if score is not None and (best_score is None or score > best_score):
                    best_score, best_epoch, improved = score, epoch + 1, True
            record["best_epoch"] = best_epoch
            if dist.enabled:
                with _peer_guard(dist, epoch, out):
                    record["ranks_agree"] = _ranks_agree(model, state, dist)
            history.append(record)
            result.best_epoch = best_epoch
            save_error = None
            if out is not None and dist.is_main:
                ckpt = {
                    "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "model_name": config.model,
                    "model_kwargs": model_kwargs,
                    "bag_pooling": config.bag_pooling,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "grad_scaler": scaler.state_dict() if scaler is not None else None,
                    "epoch": epoch + 1,
                    "step": step,
                    "pseudo_labels": state.to_dict(),
                    "rng": capture_rng(),
                    "config": ckpt_config,
                    "best": {"epoch": best_epoch, "score": None if best_score is None else list(best_score),
                             "metric": config.select_metric},
                    "metrics": {k: v for k, v in record.items() if isinstance(v, (int, float, str, type(None)))},
                }
                draw = config.plots and (epoch + 1 == config.epochs or time.perf_counter() - last_plot >= PLOT_INTERVAL_S)
                save_error = _save_epoch(out, ckpt, history, improved=improved, draw=draw)
                if draw:
                    last_plot = time.perf_counter()
            _saved_by_rank0(dist, epoch, out, failed=save_error is not None)
            if save_error is not None:
                raise save_error
            log.info("epoch %d/%d loss %.4f mu_t %.3f pseudo+ %.3f%s", epoch + 1, config.epochs, stats["loss"], mu_t,
                     label_metrics["pseudo_positive_fraction"] or 0.0,
                     "" if val is None else f" val bag_auc {record.get('val_bag_auc')} inst_auc {record.get('val_instance_auc')}")
            emit(progress, ProgressEvent(stage="train", done=epoch + 1, total=config.epochs, unit="epoch",
                                         item=f"epoch {epoch + 1}", message=f"loss {stats['loss']:.4f}"))
    model.eval()
    return result

