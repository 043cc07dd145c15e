"""Bag-classification MIL baselines over feature instances: ABMIL, gated ABMIL and max-pooling MIL,
and the small digit CNN shared with MIL-SSL.

All three baselines share MIL-SSL's instance encoder, so the comparison isolates the MIL method:

- ``mlp``: the ``mlp`` model of :mod:`wsi_milssl.mil.models` without its last (classification) layer,
  ``Standardize -> [Linear -> ReLU] * len(hidden_dims)``;
- ``digit-cnn``: :class:`DigitCNN` (registered in the model registry under that name, so MIL-SSL can
  train it in feature mode) without its head: a flattened square grey image (B, S*S) -> two 3x3
  convolutions -> 2x2 max-pool -> a fully connected embedding (the paper used AlexNet on 28x28
  MNIST; this is a CPU-sized stand-in for 8x8 digits that also takes 28x28);
- ``digit-cnn-shift``: the same CNN that, while training, moves every input digit by a random whole
  number of pixels (at most :data:`SHIFT_PX` each way, zero fill): the augmentation small-data MNIST
  wants. Evaluation (and MIL-SSL's pseudo-label refresh, which runs in eval mode) sees the digits as
  they are.

Each baseline is trained on bag labels only with binary cross-entropy on a bag logit.

- ``abmil`` (Ilse et al. 2018, attention pooling): a_j = w^T tanh(V h_j), A = softmax_j(a), z = Σ A_j h_j,
  bag logit = Linear(z).
- ``gated-abmil``: a_j = w^T (tanh(V h_j) ⊙ sigmoid(U h_j)), otherwise the same.
- ``maxpool`` (instance-level max-pooling MIL, mi-Net style): instance logit s_j = Linear(h_j),
  bag logit = max_j s_j.

Instance scores (:func:`predict_baseline`): ABMIL gives two, ``attention`` (the softmax-normalised
weight A_j, what the paper and ABMIL report) and ``attention_logit`` (the raw score a_j before the
softmax, comparable across bags and a much stronger instance scorer); max-pooling MIL gives
``instance_prob`` = sigmoid(s_j).

Bags of different sizes are padded and masked; batches hold ``bags_per_batch`` bags.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wsi_milssl.config.base import check_choice, check_range, check_type
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressCallback, ProgressEvent, emit
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.mil.models import Standardize, hidden_layers, load_state_dict_file, register_model
from wsi_milssl.runtime import restores_torch_settings

__all__ = [
    "BASELINES",
    "INSTANCE_SCORES",
    "ENCODERS",
    "BaselineConfig",
    "MLPEncoder",
    "DigitCNNEncoder",
    "DigitCNN",
    "build_encoder",
    "AttentionMIL",
    "MaxPoolingMIL",
    "build_baseline",
    "pad_bags",
    "fit_baseline",
    "predict_baseline",
]

log = logging.getLogger(__name__)

#: Baseline name -> instance scores it reports (the first is its default).
INSTANCE_SCORES: dict[str, tuple[str, ...]] = {
    "abmil": ("attention", "attention_logit"),
    "gated-abmil": ("attention", "attention_logit"),
    "maxpool": ("instance_prob",),
}
BASELINES: tuple[str, ...] = tuple(INSTANCE_SCORES)
#: Instance encoders shared by MIL-SSL and the baselines (MIL-SSL model name = encoder name).
ENCODERS: tuple[str, ...] = ("mlp", "digit-cnn", "digit-cnn-shift")
#: Largest shift (pixels, each axis) of ``digit-cnn-shift`` while training.
SHIFT_PX = 1


@dataclass(frozen=True)
class BaselineConfig:
    """Training settings of a baseline (defaults match MIL-SSL's feature mode: Adam, lr 1e-3).

    ``encoder``: "mlp" (``hidden_dims`` layer widths), "digit-cnn" or "digit-cnn-shift" (fixed
    :class:`DigitCNNEncoder`, the latter shifting its training digits);
    ``attention_dim``: width of V (and U);
    ``epochs``: passes over the training bags; ``bags_per_batch``: bags per optimizer step;
    ``weight_decay``: L2; ``seed`` seeds the initialisation and the bag order; ``threads`` > 0 sets
    torch's intra-op threads.
    """

    method: str = "abmil"
    encoder: str = "mlp"
    hidden_dims: tuple[int, ...] = (128, 64)
    attention_dim: int = 64
    epochs: int = 100
    bags_per_batch: int = 8
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 1e-4
    seed: int = 0
    threads: int = 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_choice(name, "method", self.method, BASELINES)
        check_choice(name, "encoder", self.encoder, ENCODERS)
        check_type(name, "hidden_dims", self.hidden_dims, tuple)
        if not self.hidden_dims:
            raise ConfigError(f"{name}.hidden_dims needs at least one layer width (the encoder output); got ().")
        for h in self.hidden_dims:
            check_type(name, "hidden_dims", h, int)
            check_range(name, "hidden_dims", h, low=1)
        for f in ("attention_dim", "epochs", "bags_per_batch"):
            check_type(name, f, getattr(self, f), int)
            check_range(name, f, getattr(self, f), low=1)
        check_choice(name, "optimizer", self.optimizer, ("sgd", "adam", "adamw"))
        check_range(name, "lr", self.lr, low=0.0, low_inclusive=False)
        check_range(name, "weight_decay", self.weight_decay, low=0.0)
        check_type(name, "seed", self.seed, int)
        check_range(name, "seed", self.seed, low=0)
        check_type(name, "threads", self.threads, int)
        check_range(name, "threads", self.threads, low=0)


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

class MLPEncoder(nn.Module):
    """Standardize -> [Linear -> ReLU] * len(hidden_dims): (..., D) float32 -> (..., hidden_dims[-1]).

    The same layers as the ``mlp`` model's :class:`~wsi_milssl.mil.models.FeatureHead` minus its final
    classification layer.
    """

    def __init__(self, in_features: int, *, hidden_dims: tuple[int, ...]) -> None:
        super().__init__()
        self.standardize = Standardize(in_features)
        layers, self.out_features = hidden_layers(in_features, hidden_dims)
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.standardize(x))


class DigitCNNEncoder(nn.Module):
    """A small CNN for square grey images given flattened: (..., S*S) float32 in [0, 1] -> (..., embed_dim).

    conv3x3(1 -> c1) -> ReLU -> conv3x3(c1 -> c2) -> ReLU -> maxpool 2x2 -> Linear(c2 (S/2)^2 -> embed_dim)
    -> ReLU. About 37k parameters for 8x8 digits: a training epoch over a few thousand instances takes
    well under a second on one CPU core.

    ``shift_px`` > 0: in training mode every image first moves by a random offset in
    [-shift_px, shift_px] pixels on each axis (zero fill; torch's global random stream, which the
    trainers seed).
    """

    def __init__(self, in_features: int, *, channels: tuple[int, int] = (16, 32), embed_dim: int = 64,
                 shift_px: int = 0) -> None:
        super().__init__()
        if not isinstance(shift_px, int) or shift_px < 0:
            raise ConfigError(f"digit-cnn shift_px must be an integer >= 0; got {shift_px!r}.")
        self.shift_px = shift_px
        side = int(round(math.sqrt(in_features)))
        if side * side != in_features or side < 2:
            raise ConfigError(f"digit-cnn needs flattened square images (in_features = S*S, S >= 2); got "
                              f"in_features={in_features}. Use the mlp model for other features.")
        self.side = side
        c1, c2 = channels
        self.body = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(c2 * (side // 2) ** 2, embed_dim), nn.ReLU(inplace=True),
        )
        self.out_features = embed_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        img = x.reshape(-1, 1, self.side, self.side)
        if self.training and self.shift_px > 0:
            img = random_shift(img, self.shift_px)
        h = self.body(img)
        return h.reshape(*lead, self.out_features)


def random_shift(img: torch.Tensor, shift_px: int) -> torch.Tensor:
    """(B, C, S, S) images each moved by its own random offset in [-shift_px, shift_px] pixels per axis,
    zero fill (a crop of the zero-padded image)."""
    b, _, s, _ = img.shape
    padded = F.pad(img, (shift_px,) * 4)
    start = torch.randint(0, 2 * shift_px + 1, (b, 2), device=img.device)
    span = torch.arange(s, device=img.device)
    rows = (start[:, :1] + span)[:, None, :, None]  # (B, 1, S, 1)
    cols = (start[:, 1:] + span)[:, None, None, :]  # (B, 1, 1, S)
    batch = torch.arange(b, device=img.device)[:, None, None, None]
    channel = torch.arange(img.shape[1], device=img.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


class DigitCNN(nn.Module):
    """:class:`DigitCNNEncoder` followed by a 2-class linear layer: (B, S*S) -> logits (B, 2).

    Registered as models ``digit-cnn`` and ``digit-cnn-shift`` (``shift_px`` = :data:`SHIFT_PX`), feature-mode
    models: instances are flattened images."""

    def __init__(self, in_features: int, *, num_classes: int = 2, shift_px: int = 0) -> None:
        super().__init__()
        self.encoder = DigitCNNEncoder(in_features, shift_px=shift_px)
        self.head = nn.Linear(self.encoder.out_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _digit_cnn(name: str, shift_px: int, in_features, num_classes: int, weights_path: str | None) -> nn.Module:
    if not isinstance(in_features, int) or in_features < 4:
        raise ConfigError(f"model {name!r} needs in_features (S*S pixels) >= 4; got {in_features!r}.")
    model = DigitCNN(in_features, num_classes=num_classes, shift_px=shift_px)
    if weights_path:  # read like the other models' weights (wsi_milssl.weights), every tensor from the file
        load_state_dict_file(model, weights_path, skip_prefix="\0")
    return model


@register_model("digit-cnn")
def digit_cnn(*, in_features: int | None = None, num_classes: int = 2, weights_path: str | None = None,
              **_ignored) -> nn.Module:
    """:class:`DigitCNN` over flattened square grey images (``in_features`` = S*S)."""
    return _digit_cnn("digit-cnn", 0, in_features, num_classes, weights_path)


@register_model("digit-cnn-shift")
def digit_cnn_shift(*, in_features: int | None = None, num_classes: int = 2, weights_path: str | None = None,
                    **_ignored) -> nn.Module:
    """:class:`DigitCNN` that shifts its training digits by up to :data:`SHIFT_PX` pixels."""
    return _digit_cnn("digit-cnn-shift", SHIFT_PX, in_features, num_classes, weights_path)


def build_encoder(name: str, in_features: int, *, hidden_dims: tuple[int, ...] = (128, 64)) -> nn.Module:
    """The shared instance encoder ``name`` (one of :data:`ENCODERS`); it has ``out_features``."""
    if name == "mlp":
        return MLPEncoder(in_features, hidden_dims=tuple(hidden_dims))
    if name in ("digit-cnn", "digit-cnn-shift"):
        return DigitCNNEncoder(in_features, shift_px=SHIFT_PX if name == "digit-cnn-shift" else 0)
    raise ConfigError(f"unknown encoder {name!r}; choose one of {', '.join(ENCODERS)}.")


class AttentionMIL(nn.Module):
    """Attention-pooling MIL (ABMIL), optionally gated.

    ``forward(x, mask)`` with x float32 (n_bags, max_size, D) and mask bool (n_bags, max_size) (True for
    a real instance) returns ``(bag_logits (n_bags,), attention_logits (n_bags, max_size))``; padded
    positions have attention logit -inf.
    """

    def __init__(self, encoder: nn.Module, *, attention_dim: int = 64, gated: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        width = encoder.out_features
        self.attention_v = nn.Linear(width, attention_dim)
        self.attention_u = nn.Linear(width, attention_dim) if gated else None
        self.attention_w = nn.Linear(attention_dim, 1)
        self.classifier = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)  # (n, m, E)
        v = torch.tanh(self.attention_v(h))
        if self.attention_u is not None:
            v = v * torch.sigmoid(self.attention_u(h))
        a = self.attention_w(v).squeeze(-1)  # (n, m) raw attention logits
        if mask is not None:
            a = a.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(a, dim=1)
        z = torch.einsum("nm,nme->ne", weights, h)
        return self.classifier(z).squeeze(-1), a


class MaxPoolingMIL(nn.Module):
    """Instance-level max-pooling MIL: instance logits s_j = Linear(h_j), bag logit = max_j s_j.

    ``forward(x, mask)`` returns ``(bag_logits (n_bags,), instance_logits (n_bags, max_size))``.
    """

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.classifier = nn.Linear(encoder.out_features, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.classifier(self.encoder(x)).squeeze(-1)
        pooled = s if mask is None else s.masked_fill(~mask, float("-inf"))
        return pooled.max(dim=1).values, s


def build_baseline(method: str, in_features: int, *, encoder: str = "mlp", hidden_dims: tuple[int, ...] = (128, 64),
                   attention_dim: int = 64) -> nn.Module:
    """A fresh baseline model ``method`` ("abmil", "gated-abmil" or "maxpool") over ``in_features``
    with the shared ``encoder`` (one of :data:`ENCODERS`)."""
    if method not in INSTANCE_SCORES:
        raise ConfigError(f"unknown baseline {method!r}; choose one of {', '.join(BASELINES)}.")
    encoder = build_encoder(encoder, in_features, hidden_dims=hidden_dims)
    if method == "maxpool":
        return MaxPoolingMIL(encoder)
    return AttentionMIL(encoder, attention_dim=attention_dim, gated=method == "gated-abmil")


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def pad_bags(instances: InstanceSet) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Group a feature InstanceSet by bag.

    Returns ``(x float32 (n_bags, max_size, D), mask bool (n_bags, max_size), slot int64 (N,))`` where
    instance i sits at ``x[bag_ids[i], slot[i]]`` and padding is zero with mask False.
    """
    if instances.kind != "features" or instances.features is None:
        raise ConfigError("the MIL baselines take feature instances (kind 'features'); image bags are not supported.")
    bag_ids = instances.bag_ids
    n = len(instances)
    counts = np.bincount(bag_ids, minlength=instances.n_bags)
    order = np.argsort(bag_ids, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.empty(n, dtype=np.int64)
    slot[order] = np.arange(n) - np.repeat(starts, counts)
    max_size = int(counts.max()) if counts.size else 0
    x = torch.zeros(instances.n_bags, max_size, instances.in_features, dtype=torch.float32)
    mask = torch.zeros(instances.n_bags, max_size, dtype=torch.bool)
    bi = torch.from_numpy(bag_ids)
    si = torch.from_numpy(slot)
    x[bi, si] = torch.from_numpy(np.ascontiguousarray(instances.features, dtype=np.float32))
    mask[bi, si] = True
    return x, mask, slot


def _make_optimizer(model: nn.Module, config: BaselineConfig) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def _seed(seed: int, *stream: int) -> int:
    return int(np.random.SeedSequence([int(seed), 0xBA5E, *stream]).generate_state(1, dtype=np.uint64)[0] >> 1)


# ----------------------------------------------------------------------------------------------
# Training and prediction
# ----------------------------------------------------------------------------------------------

@restores_torch_settings
def fit_baseline(train: InstanceSet, *, config: BaselineConfig,
                 progress: ProgressCallback | None = None,
                 on_epoch: Callable[[int, nn.Module], None] | None = None) -> nn.Module:
    """Train baseline ``config.method`` on the bag labels of ``train`` (instance labels are never read).

    Binary cross-entropy on the bag logit, ``config.epochs`` passes over the bags in a seeded random
    order, ``config.bags_per_batch`` bags per step. Returns the model in eval mode (on the CPU).
    Reproducible: the same seed, data and thread count give the same weights. ``on_epoch(epoch, model)``
    is called after every epoch (1-based count) to score snapshots (e.g. :func:`predict_baseline`);
    it must not change the model's weights.
    """
    labels = train.bag_labels
    if not ((labels == 0).any() and (labels == 1).any()):
        raise ConfigError(f"{train.source or 'training bags'}: the baselines need positive and negative bags; "
                          f"got {int((labels == 1).sum())} positive of {train.n_bags}.")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    torch.manual_seed(_seed(config.seed, 0))
    model = build_baseline(config.method, int(train.in_features), encoder=config.encoder,
                           hidden_dims=config.hidden_dims, attention_dim=config.attention_dim)
    if hasattr(model.encoder, "standardize"):
        model.encoder.standardize.set_stats(torch.from_numpy(np.ascontiguousarray(train.features)))
    x, mask, _ = pad_bags(train)
    y = torch.from_numpy(labels.astype(np.float32))
    optimizer = _make_optimizer(model, config)
    model.train()
    n_bags = train.n_bags
    emit(progress, ProgressEvent(stage="baseline", done=0, total=config.epochs, unit="epoch", item=config.method))
    for epoch in range(config.epochs):
        g = torch.Generator()
        g.manual_seed(_seed(config.seed, 1, epoch))
        order = torch.randperm(n_bags, generator=g)
        total = 0.0
        for i in range(0, n_bags, config.bags_per_batch):
            b = order[i:i + config.bags_per_batch]
            logits, _ = model(x[b], mask[b])
            loss = F.binary_cross_entropy_with_logits(logits, y[b])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * b.numel()
        if not math.isfinite(total):
            raise ConfigError(f"{config.method}: training diverged (loss {total}); lower the learning rate.")
        emit(progress, ProgressEvent(stage="baseline", done=epoch + 1, total=config.epochs, unit="epoch",
                                     item=config.method, message=f"loss {total / n_bags:.4f}"))
        if on_epoch is not None:
            on_epoch(epoch + 1, model)
            model.train()
    model.eval()
    return model


@torch.no_grad()
def predict_baseline(model: nn.Module, instances: InstanceSet, *, bags_per_batch: int = 256) -> dict[str, Any]:
    """Bag and instance scores of a trained baseline on ``instances``.

    Returns ``{"bag_scores": float64 (n_bags,) sigmoid of the bag logit, "instance_scores": {name:
    float64 (N,)}}`` in the order of ``instances``: ``attention`` (softmax weight within its bag) and
    ``attention_logit`` for the attention models, ``instance_prob`` for max-pooling.
    """
    was_training = model.training
    model.eval()
    x, mask, slot = pad_bags(instances)
    bag_logits, inst = [], []
    for i in range(0, instances.n_bags, bags_per_batch):
        bl, il = model(x[i:i + bags_per_batch], mask[i:i + bags_per_batch])
        bag_logits.append(bl)
        inst.append(il)
    model.train(was_training)
    bag = torch.cat(bag_logits).double()
    raw = torch.cat(inst).double()
    bi, si = torch.from_numpy(instances.bag_ids), torch.from_numpy(slot)
    if isinstance(model, AttentionMIL):
        weights = torch.softmax(raw, dim=1)
        scores = {"attention": weights[bi, si].numpy(), "attention_logit": raw[bi, si].numpy()}
    else:
        scores = {"instance_prob": torch.sigmoid(raw)[bi, si].numpy()}
    return {"bag_scores": torch.sigmoid(bag).numpy(), "instance_scores": scores}
