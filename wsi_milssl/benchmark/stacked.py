"""Many small MIL models trained at once: the grid points and folds of one nested-CV split as one stack.

The benchmark (:mod:`wsi_milssl.benchmark.mil_csv`) trains, inside each outer training split, every
grid point on every inner fold plus once on the whole split. Those models are tiny (a feature MLP), so
one at a time the run is dominated by per-step overhead. Here M models share one forward pass: every
weight has a leading model axis (M, ...), every model sees the same batch and each model's loss only
counts the bags (or instances) of its own training set, given as a 0/1 weight per model. The models
never mix: a model's gradient comes from its own loss alone; its hyperparameters (learning rate, weight
decay, dropout, attention width, μ, T) are per-model tensors.

Two trainers:

- :func:`fit_stacked_baseline`: ABMIL, gated ABMIL and max-pooling MIL as in
  :mod:`wsi_milssl.benchmark.baselines` (same encoder ``Standardize -> [Linear -> ReLU]*``, same
  attention and classifier, bag-level binary cross-entropy, Adam), with per-model attention width
  (units beyond a model's width are masked out) and encoder dropout.
- :func:`fit_stacked_milssl`: MIL-SSL (paper eq. 2-11) with the feature ``mlp``/``linear`` heads of
  :mod:`wsi_milssl.mil.models`: negatives are 0, the positive-bag instances get pseudo labels at the
  start of every epoch from :func:`stacked_pseudo_labels` (the Sinkhorn solution of eq. 5-8 plus the
  local constraint, per model, with per-model μ_t of eq. 10), soft cross-entropy (eq. 9), Adam.

Both standardise with each model's own training instances (mean and std per model), evaluate at the
epochs in ``eval_at`` and return probabilities / bag scores of the given evaluation sets per model.
Everything is seeded: a fixed seed and thread count give the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from wsi_milssl.errors import ConfigError
from wsi_milssl.mil.data import InstanceSet
from wsi_milssl.mil.sinkhorn import PROB_EPS, check_lam

__all__ = ["StackedData", "stacked_pseudo_labels", "fit_stacked_baseline", "fit_stacked_milssl", "pool_bags",
           "instance_loss_weights", "neighbour_graphs", "POOLINGS"]

#: Bag scores from instance probabilities (MIL-SSL): max (eq. 11), mean, mean of the top two, mean of the
#: top half, noisy-or.
POOLINGS = ("max", "mean", "top2", "top-half", "noisy-or")


def _seed(*stream: int) -> int:
    return int(np.random.SeedSequence([0x57AC, *[int(s) for s in stream]]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _gen(*stream: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(_seed(*stream))
    return g


@dataclass
class StackedData:
    """The instances of one training split, flat.

    ``x`` float32 (N, D); ``bag_ids`` int64 (N,) into ``bag_labels`` int64 (B,);
    ``bag_weight`` float32 (M, B): 1 where bag b is in model m's training set.
    """

    x: torch.Tensor
    bag_ids: torch.Tensor
    bag_labels: torch.Tensor
    bag_weight: torch.Tensor

    @classmethod
    def from_instances(cls, instances: InstanceSet, bag_weight: np.ndarray) -> "StackedData":
        if instances.kind != "features" or instances.features is None:
            raise ConfigError("stacked training takes feature instances (a MIL CSV or feature files).")
        w = np.asarray(bag_weight, dtype=np.float32)
        if w.ndim != 2 or w.shape[1] != instances.n_bags:
            raise ConfigError(f"bag_weight must be (models, {instances.n_bags}); got {w.shape}.")
        return cls(x=torch.from_numpy(np.ascontiguousarray(instances.features, dtype=np.float32)),
                   bag_ids=torch.from_numpy(instances.bag_ids.astype(np.int64)),
                   bag_labels=torch.from_numpy(instances.bag_labels.astype(np.int64)),
                   bag_weight=torch.from_numpy(w))

    @property
    def n_models(self) -> int:
        return int(self.bag_weight.shape[0])

    def instance_weight(self) -> torch.Tensor:
        """float32 (M, N): 1 where instance i belongs to model m's training bags."""
        return self.bag_weight[:, self.bag_ids]

    def standardisation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-model mean and std (M, 1, D) of the model's training instances (a constant feature keeps 1)."""
        w = self.instance_weight().double()  # (M, N)
        x = self.x.double()
        n = w.sum(1, keepdim=True).clamp_min(1.0)
        mean = (w @ x) / n
        var = ((w @ (x * x)) / n - mean * mean).clamp_min(0.0)
        std = var.sqrt()
        std = torch.where(std > 1e-12, std, torch.ones_like(std))
        return mean.float().unsqueeze(1), std.float().unsqueeze(1)

    def sorted_training_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per model, every feature's training values in ascending order, float32 (M, D, n_max) padded with
        +inf, and the models' training instance counts (M,): the empirical distributions of :func:`rank_gauss`."""
        w = self.instance_weight().bool()  # (M, N)
        counts = w.sum(1)
        out = torch.full((self.n_models, int(self.x.shape[1]), max(int(counts.max()), 1)), math.inf)
        for k in range(self.n_models):
            values = self.x[w[k]].T  # (D, n_k)
            out[k, :, :values.shape[1]] = values.sort(dim=1).values
        return out, counts


def rank_gauss(x: torch.Tensor, sorted_values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(M, n, D): every feature of ``x`` (n, D) mapped through model m's empirical distribution function
    to a standard normal score, z = Φ⁻¹(u) with u = (#{v < x} + #{v <= x}) / (2 n_m) over the model's
    training values v, clipped to [1 / (2 n_m), 1 - 1 / (2 n_m)] (a rank-Gauss or quantile transform: the
    scale and skew of a feature no longer matter, only its order; ties get their mid rank)."""
    m, d, _ = sorted_values.shape
    xs = x.T.unsqueeze(0).expand(m, d, x.shape[0]).contiguous()
    below = torch.searchsorted(sorted_values, xs, right=False)
    at_most = torch.searchsorted(sorted_values, xs, right=True)
    n = counts.clamp_min(1).view(-1, 1, 1).double()
    u = ((below + at_most).double() / (2 * n)).clamp(min=0.5 / n, max=1 - 0.5 / n)
    return (math.sqrt(2.0) * torch.erfinv(2 * u - 1)).float().transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# Stacked layers and optimizer
# ----------------------------------------------------------------------------------------------

def _linear_init(m: int, fan_in: int, fan_out: int, gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), one generator per model."""
    bound = 1.0 / math.sqrt(fan_in)
    w = torch.stack([(torch.rand(fan_in, fan_out, generator=g) * 2 - 1) * bound for g in gens])
    b = torch.stack([(torch.rand(1, fan_out, generator=g) * 2 - 1) * bound for g in gens])
    return w.requires_grad_(), b.requires_grad_()


def _apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, n, I) or (n, I) @ (M, I, O) + (M, 1, O) -> (M, n, O)."""
    return torch.baddbmm(b, x, w) if x.dim() == 3 else torch.matmul(x, w) + b


class _Adam:
    """Adam (torch's update, L2 weight decay added to the gradient) with per-model learning rate and
    weight decay: ``lr`` and ``wd`` are (M,) tensors broadcast over each parameter's model axis."""

    def __init__(self, params: list[torch.Tensor], lr: torch.Tensor, wd: torch.Tensor,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = params
        self.lr, self.wd, self.betas, self.eps = lr.float(), wd.float(), betas, eps
        self.any_wd = bool((self.wd != 0).any())
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        # torch's Adam, p -= lr/c1 * m / (sqrt(v/c2) + eps), rewritten with the bias corrections folded
        # into one per-model factor: lr sqrt(c2)/c1 * m / (sqrt(v) + eps sqrt(c2)); fewer passes over
        # the (memory-bound) stacked weights.
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        factor = self.lr * (math.sqrt(c2) / c1)
        eps = self.eps * math.sqrt(c2)
        for p, m, v in zip(self.params, self.m, self.v):
            shape = (-1,) + (1,) * (p.dim() - 1)
            g = p.grad
            if self.any_wd:
                g.add_(p * self.wd.view(shape))
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            update = m / v.sqrt().add_(eps)
            p.sub_(update.mul_(factor.view(shape)))
            p.grad = None


def _beta(alpha: float, n: int, g: torch.Generator) -> torch.Tensor:
    """n draws of Beta(alpha, alpha) (float32), seeded from ``g``."""
    rng = np.random.default_rng(int(torch.randint(2 ** 62, (1,), generator=g)))
    return torch.from_numpy(rng.beta(alpha, alpha, n).astype(np.float32))


def _dropout(h: torch.Tensor, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Inverted dropout with per-model rate ``p`` (M,) on h (M, n, H)."""
    if not bool((p > 0).any()):
        return h
    keep = 1.0 - p.view(-1, 1, 1)
    mask = (torch.rand(h.shape, generator=g) < keep).to(h.dtype)
    return h * mask / keep


# ----------------------------------------------------------------------------------------------
# Segment helpers (instances grouped by bag)
# ----------------------------------------------------------------------------------------------

def _segment_max(values: torch.Tensor, seg: torch.Tensor, n_seg: int) -> torch.Tensor:
    """(M, n) values, (n,) segment index -> (M, n_seg) maxima (-inf for empty segments)."""
    out = torch.full((values.shape[0], n_seg), float("-inf"), dtype=values.dtype)
    return out.scatter_reduce(1, seg.expand(values.shape[0], -1), values, reduce="amax", include_self=True)


def _segment_sum(values: torch.Tensor, seg: torch.Tensor, n_seg: int) -> torch.Tensor:
    """(M, n, ...) values -> (M, n_seg, ...) sums over segments."""
    out = torch.zeros((values.shape[0], n_seg) + tuple(values.shape[2:]), dtype=values.dtype)
    return out.index_add(1, seg, values)


def pool_bags(probs: np.ndarray, bag_ids: np.ndarray, n_bags: int, pooling: str) -> np.ndarray:
    """Bag scores (M, n_bags) float64 from instance probabilities (M, N): ``max`` (eq. 11), ``mean``,
    ``top2`` (mean of the two highest; the highest alone in a one-instance bag), ``top-half`` (mean of the
    highest ceil(n / 2) of a bag's n) or ``noisy-or`` (1 - Π(1 - p)); NaN for a bag without instances."""
    p = torch.from_numpy(np.asarray(probs, dtype=np.float64))
    seg = torch.from_numpy(np.asarray(bag_ids, dtype=np.int64))
    if pooling == "max":
        out = _segment_max(p, seg, n_bags)
    elif pooling == "mean":
        counts = torch.bincount(seg, minlength=n_bags).double()
        out = _segment_sum(p, seg, n_bags) / counts
    elif pooling in ("top2", "top-half"):
        arr = p.numpy()
        seg_np = seg.numpy()
        sizes = np.bincount(seg_np, minlength=n_bags)
        keep = np.minimum(sizes, 2) if pooling == "top2" else np.ceil(sizes / 2.0).astype(np.int64)
        out = torch.empty(arr.shape[0], n_bags, dtype=torch.float64)
        for row in range(arr.shape[0]):
            order = np.lexsort((-arr[row], seg_np))  # by bag, then probability descending
            sb = seg_np[order]
            rank = np.arange(sb.size) - np.searchsorted(sb, sb)  # 0 for each bag's highest probability
            top = rank < keep[sb]
            total = np.bincount(sb[top], weights=arr[row][order][top], minlength=n_bags)
            out[row] = torch.from_numpy(np.where(sizes > 0, total / np.maximum(keep, 1), np.nan))
    elif pooling == "noisy-or":
        logs = torch.log1p(-p.clamp(0.0, 1.0 - 1e-12))
        out = 1.0 - torch.exp(_segment_sum(logs, seg, n_bags))
    else:
        raise ConfigError(f"bag pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}.")
    return out.numpy()


# ----------------------------------------------------------------------------------------------
# Pseudo labels for a stack of models
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def stacked_pseudo_labels(probs: torch.Tensor, mask: torch.Tensor, bag_ids: torch.Tensor, *,
                          mu: torch.Tensor, lam: float, soft: bool = True, local_constraint: bool = True,
                          global_constraint: bool = True, per_bag: bool = False, iters: int = 80) -> torch.Tensor:
    """Pseudo labels (M, N) float32 for M models at once, each over its own instances (``mask`` (M, N)).

    With two classes and unit column marginals the Sinkhorn solution of eq. 7 is
    Q[0, i] = sigmoid(λ logit(p_i) + s), where the shift s = log(α_0 / α_1) makes Σ_i Q[0, i] = μN
    (row marginal, eq. 5). s is found per model by bisection in float64 (``iters`` halvings of a bracket
    that holds every root), which is the fixed point :func:`wsi_milssl.mil.sinkhorn.assign_pseudo_labels`
    iterates to. Then ``soft=False`` binarises at 0.5 and the local constraint sets each bag's
    top-probability instance to 1 (one instance: the first of tied maxima, as there). Entries outside
    ``mask`` are 0. ``mu`` is (M,). ``per_bag``: the fraction μ holds in every positive bag (one shift per
    model and bag) instead of over all of a model's positive-bag instances together, where the large bags
    decide where the negatives go. ``lam`` is λ, 0 < λ <= :data:`wsi_milssl.mil.sinkhorn.LAM_MAX`.
    """
    lam = check_lam(lam)
    p = probs.double().clamp(PROB_EPS, 1.0 - PROB_EPS)
    m = mask.bool()
    if global_constraint:
        z = lam * (torch.log(p) - torch.log1p(-p))
        # one shift per model, or per model and bag: segment g of instance i is 0, or its bag
        seg = bag_ids if per_bag else torch.zeros_like(bag_ids)
        n_seg = int(seg.max()) + 1 if seg.numel() else 1
        n = _segment_sum(m.double(), seg, n_seg)
        target = mu.double()[:, None] * n
        bound = float(z.abs().max()) + 60.0 if z.numel() else 60.0
        lo = torch.full((p.shape[0], n_seg), -bound, dtype=torch.float64)
        hi = torch.full((p.shape[0], n_seg), bound, dtype=torch.float64)
        for _ in range(iters):
            mid = (lo + hi) / 2
            total = _segment_sum(torch.where(m, torch.sigmoid(z + mid[:, seg]), torch.zeros_like(z)), seg, n_seg)
            below = total < target
            lo = torch.where(below, mid, lo)
            hi = torch.where(below, hi, mid)
        q = torch.sigmoid(z + ((lo + hi) / 2)[:, seg])
    else:
        q = p.clone()
    if not soft:
        q = (q > 0.5).double()
    if local_constraint:
        # one instance per bag and model: the first (lowest index) of its tied maxima, as
        # assign_pseudo_labels (probabilities saturate to exactly 1.0 in float32, so ties are common)
        n_bags = int(bag_ids.max()) + 1 if bag_ids.numel() else 0
        masked = p.masked_fill(~m, -1.0)
        top = _segment_max(masked, bag_ids, n_bags)
        index = torch.arange(p.shape[1], dtype=torch.float64).expand_as(p)
        tied = m & (masked == top[:, bag_ids])
        first = -_segment_max(torch.where(tied, -index, torch.full_like(index, -math.inf)), bag_ids, n_bags)
        q = torch.where(tied & (index == first[:, bag_ids]), torch.ones_like(q), q)
    return torch.where(m, q, torch.zeros_like(q)).float()


# ----------------------------------------------------------------------------------------------
# Baselines (bag level)
# ----------------------------------------------------------------------------------------------

def _bag_batches(order: torch.Tensor, grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 bags_per_batch: int):
    """Yield (bags (b,), instance indices (n,), local bag index (n,)) for consecutive chunks of ``order``."""
    inst_order, starts, counts = grouped  # from _group: instance order by bag, bag starts, bag sizes
    for i in range(0, order.numel(), bags_per_batch):
        bags = order[i:i + bags_per_batch]
        idx = torch.cat([inst_order[starts[b]:starts[b] + counts[b]] for b in bags.tolist()])
        local = torch.repeat_interleave(torch.arange(bags.numel()), counts[bags])
        yield bags, idx, local


def _group(bag_ids: torch.Tensor, n_bags: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    counts = torch.bincount(bag_ids, minlength=n_bags)
    order = torch.argsort(bag_ids, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    return order, starts, counts


class _StackedBaseline:
    """Stacked ABMIL / gated ABMIL / max-pooling MIL over a shared MLP encoder (see the module doc)."""

    def __init__(self, method: str, in_features: int, *, hidden_dims: Sequence[int], attention_dims: torch.Tensor,
                 dropout: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, gens: list[torch.Generator]) -> None:
        m = len(gens)
        self.method, self.mean, self.std, self.dropout = method, mean, std, dropout
        self.layers = []
        width = in_features
        for h in hidden_dims:
            self.layers.append(_linear_init(m, width, int(h), gens))
            width = int(h)
        self.params = [t for layer in self.layers for t in layer]
        if method in ("abmil", "gated-abmil"):
            a_max = int(attention_dims.max())
            self.att_mask = (torch.arange(a_max)[None, :] < attention_dims[:, None]).float().unsqueeze(1)  # (M,1,A)
            # each model initialises its own width, so its V/U/w match nn.Linear(width, a_m), nn.Linear(a_m, 1)
            self.v = _linear_init(m, width, a_max, gens)
            self.u = _linear_init(m, width, a_max, gens) if method == "gated-abmil" else None
            self.w = _linear_init(m, a_max, 1, gens)
            with torch.no_grad():  # w's fan-in is the model's own width a_m
                scale = (a_max / attention_dims.double()).sqrt().float().view(-1, 1, 1)
                self.w[0].mul_(scale)
                self.w[1].mul_(scale)
            self.params += [*self.v, *(self.u or ()), *self.w]
        self.cls = _linear_init(m, width, 1, gens)
        self.params += list(self.cls)

    def encode(self, x: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        h = (x.unsqueeze(0) - self.mean) / self.std  # (M, n, D)
        for w, b in self.layers:
            h = torch.relu(_apply(h, w, b))
            if g is not None:
                h = _dropout(h, self.dropout, g)
        return h

    def forward(self, x: torch.Tensor, local: torch.Tensor, n_bags: int, g: torch.Generator | None
                ) -> torch.Tensor:
        """Bag logits (M, n_bags) of the bags whose instances are ``x`` (n, D) with bag index ``local``."""
        h = self.encode(x, g)
        if self.method == "maxpool":
            s = _apply(h, *self.cls).squeeze(-1)  # (M, n)
            return _segment_max(s, local, n_bags)
        v = torch.tanh(_apply(h, *self.v))
        if self.u is not None:
            v = v * torch.sigmoid(_apply(h, *self.u))
        a = _apply(v * self.att_mask, *self.w).squeeze(-1)  # (M, n)
        amax = _segment_max(a.detach(), local, n_bags)
        e = torch.exp(a - amax[:, local])
        weights = e / _segment_sum(e, local, n_bags)[:, local]
        z = _segment_sum(weights.unsqueeze(-1) * h, local, n_bags)  # (M, b, E)
        return _apply(z, *self.cls).squeeze(-1)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, bag_ids: torch.Tensor, n_bags: int, *, chunk_bags: int = 64) -> np.ndarray:
        """Bag probabilities (M, n_bags) float64."""
        grouped = _group(bag_ids, n_bags)
        out = torch.empty(len(self.mean), n_bags, dtype=torch.float64)
        for bags, idx, local in _bag_batches(torch.arange(n_bags), grouped, chunk_bags):
            out[:, bags] = torch.sigmoid(self.forward(x[idx], local, bags.numel(), None)).double()
        return out.numpy()


def fit_stacked_baseline(data: StackedData, *, method: str, lr: Sequence[float], weight_decay: Sequence[float],
                         attention_dim: Sequence[int], dropout: Sequence[float], hidden_dims: Sequence[int] = (128, 64),
                         bags_per_batch: int = 8, eval_at: Sequence[int], eval_sets: dict[str, InstanceSet],
                         seeds: Sequence[int], seed: int = 0) -> dict[str, dict[int, np.ndarray]]:
    """Train M = len(lr) baselines ``method`` at once on ``data`` (model m on its bags, ``data.bag_weight[m]``).

    Every per-model sequence has length M; ``seeds[m]`` seeds model m's initialisation; ``seed`` the bag
    order and dropout shared by the stack. Returns ``{set name: {epoch: bag probabilities (M, n_bags)}}``
    for each evaluation set at each epoch in ``eval_at`` (``"train"`` is the training split itself).
    """
    m = data.n_models
    for name, seq in (("lr", lr), ("weight_decay", weight_decay), ("attention_dim", attention_dim),
                      ("dropout", dropout), ("seeds", seeds)):
        if len(seq) != m:
            raise ConfigError(f"{name} needs one value per model ({m}); got {len(seq)}.")
    if method not in ("abmil", "gated-abmil", "maxpool"):
        raise ConfigError(f"unknown baseline {method!r}; choose abmil, gated-abmil or maxpool.")
    mean, std = data.standardisation()
    gens = [_gen(1, s) for s in seeds]
    model = _StackedBaseline(method, int(data.x.shape[1]), hidden_dims=hidden_dims,
                             attention_dims=torch.tensor(list(attention_dim)), dropout=torch.tensor(list(dropout)),
                             mean=mean, std=std, gens=gens)
    opt = _Adam(model.params, torch.tensor(list(lr)), torch.tensor(list(weight_decay)))
    n_bags = int(data.bag_labels.numel())
    grouped = _group(data.bag_ids, n_bags)
    y = data.bag_labels.float()
    sets = {"train": (data.x, data.bag_ids, n_bags)}
    for name, s in eval_sets.items():
        sets[name] = (torch.from_numpy(np.ascontiguousarray(s.features, dtype=np.float32)),
                      torch.from_numpy(s.bag_ids.astype(np.int64)), s.n_bags)
    wanted = sorted({int(e) for e in eval_at})
    out: dict[str, dict[int, np.ndarray]] = {name: {} for name in sets}
    for epoch in range(max(wanted)):
        order = torch.randperm(n_bags, generator=_gen(2, seed, epoch))
        g = _gen(3, seed, epoch)
        for bags, idx, local in _bag_batches(order, grouped, bags_per_batch):
            logits = model.forward(data.x[idx], local, bags.numel(), g)  # (M, b)
            w = data.bag_weight[:, bags]
            loss = F.binary_cross_entropy_with_logits(logits, y[bags].expand_as(logits), reduction="none")
            per_model = (loss * w).sum(1) / w.sum(1).clamp_min(1.0)
            per_model.sum().backward()
            opt.step()
        if epoch + 1 in wanted:
            for name, (x, bid, nb) in sets.items():
                out[name][epoch + 1] = model.predict(x, bid, nb)
            if not np.isfinite(out["train"][epoch + 1]).all():
                raise ConfigError(f"{method}: training diverged (non-finite scores). Fix: lower the learning rate or "
                                  "check the features for extreme values.")
    return out


# ----------------------------------------------------------------------------------------------
# MIL-SSL (instance level)
# ----------------------------------------------------------------------------------------------

class _StackedHead:
    """Stacked ``Standardize -> [Linear -> ReLU -> Dropout]* -> Linear(2)`` (the ``mlp``/``linear`` heads);
    ``quantiles`` (:meth:`StackedData.sorted_training_values`) standardises by :func:`rank_gauss` instead."""

    def __init__(self, in_features: int, *, hidden_dims: Sequence[int], dropout: torch.Tensor, mean: torch.Tensor,
                 std: torch.Tensor, gens: list[torch.Generator], rff: tuple[torch.Tensor, torch.Tensor] | None = None,
                 quantiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        m = len(gens)
        self.mean, self.std, self.dropout, self.rff, self.quantiles = mean, std, dropout, rff, quantiles
        self.layers = []
        width = in_features if rff is None else int(rff[0].shape[1])
        for h in list(hidden_dims) + [2]:
            self.layers.append(_linear_init(m, width, int(h), gens))
            width = int(h)
        self.params = [t for layer in self.layers for t in layer]

    def logits(self, x: torch.Tensor, g: torch.Generator | None, *, noise: torch.Tensor | None = None,
               layers: list | None = None) -> torch.Tensor:
        """(M, n, 2) logits; ``g`` draws dropout (training), ``noise`` (M,) adds N(0, noise²) to the
        standardised features (training, drawn from ``g``), ``layers`` replaces the weights (their average)."""
        h = (x.unsqueeze(0) - self.mean) / self.std if self.quantiles is None else rank_gauss(x, *self.quantiles)
        if g is not None and noise is not None:
            h = h + noise.view(-1, 1, 1) * torch.randn(h.shape[0], h.shape[1], h.shape[2], generator=g)
        if self.rff is not None:  # random Fourier features of a Gaussian kernel on the standardised features
            w, b = self.rff
            h = torch.cos(torch.matmul(h, w) + b) * math.sqrt(2.0 / w.shape[1])
        layers = self.layers if layers is None else layers
        for i, (w, b) in enumerate(layers):
            h = _apply(h, w, b)
            if i < len(layers) - 1:
                h = torch.relu(h)
                if g is not None:
                    h = _dropout(h, self.dropout, g)
        return h  # (M, n, 2)

    @torch.no_grad()
    def probs(self, x: torch.Tensor, *, chunk: int = 2048, layers: list | None = None) -> torch.Tensor:
        parts = [torch.softmax(self.logits(x[i:i + chunk], None, layers=layers), dim=-1)[..., 1]
                 for i in range(0, x.shape[0], chunk)]
        return torch.cat(parts, dim=1) if parts else torch.zeros(len(self.mean), 0)


class _WeightAverage:
    """An exponential moving average of a head's weights: after every step a ← d a + (1 - d) w with
    d = min(exp(-1 / (epochs x steps per epoch)), (1 + t) / (10 + t)) at step t (the average forgets the
    starting weights within the first steps, then spans about ``epochs`` epochs of steps)."""

    def __init__(self, layers: list, epochs: float, steps_per_epoch: int) -> None:
        self.layers = [(w.detach().clone(), b.detach().clone()) for w, b in layers]
        self.decay = math.exp(-1.0 / (float(epochs) * max(1, steps_per_epoch)))
        self.t = 0

    @torch.no_grad()
    def update(self, layers: list) -> None:
        d = min(self.decay, (1 + self.t) / (10 + self.t))
        self.t += 1
        for (aw, ab), (w, b) in zip(self.layers, layers):
            aw.lerp_(w, 1 - d)
            ab.lerp_(b, 1 - d)


def neighbour_graphs(data: StackedData, pos_idx: torch.Tensor, k: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The k-nearest-neighbour graphs of the positive-bag instances ``pos_idx``, one per group of models
    that train on the same bags: (models (G,), members (n,) positions into ``pos_idx`` of the group's own
    positive-bag training instances, near (n, k') positions into ``members``: each member and its k
    nearest other members, k' = min(k + 1, n)). A graph is built from the group's own instances alone,
    standardised with their own mean and std, so bags a model does not train on (their features and
    labels) never shape its graph."""
    from sklearn.neighbors import NearestNeighbors

    inst_w = data.instance_weight()[:, pos_idx] > 0  # (M, n_pos)
    graphs = []
    rows = data.bag_weight.numpy()
    for key in dict.fromkeys(r.tobytes() for r in rows):
        models = torch.from_numpy(np.flatnonzero([r.tobytes() == key for r in rows]))
        members = torch.nonzero(inst_w[int(models[0])]).flatten()
        if members.numel() < 2:
            continue
        x = data.x[pos_idx[members]].double()
        x = ((x - x.mean(0)) / x.std(0).clamp_min(1e-12)).numpy()
        kk = min(int(k) + 1, members.numel())
        found = NearestNeighbors(n_neighbors=kk).fit(x).kneighbors(x, return_distance=False)
        # the instance itself first, then its kk - 1 nearest others (a duplicate may come before itself)
        near = np.stack([np.concatenate([[i], row[row != i][:kk - 1]]) for i, row in enumerate(found)])
        graphs.append((models, members, torch.from_numpy(near)))
    return graphs


def instance_loss_weights(data: StackedData, bag_balanced: Sequence[bool] | bool = False) -> torch.Tensor:
    """float32 (M, N): each instance's weight in model m's loss, 0 outside its training bags; 1 inside, or
    1 / (size of the instance's bag) where ``bag_balanced`` (one flag, or one per model) is set, so every
    training bag then carries the same total weight."""
    inst_w = data.instance_weight()
    balanced = torch.as_tensor(bag_balanced, dtype=torch.bool).expand(data.n_models)
    if not bool(balanced.any()):
        return inst_w
    sizes = torch.bincount(data.bag_ids, minlength=int(data.bag_labels.numel())).float()
    return torch.where(balanced[:, None], inst_w / sizes[data.bag_ids][None, :], inst_w)


def _max_bag_loss(model: _StackedHead, data: StackedData, chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  bag_y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """(M,) mean over each model's training bags of ``chunk`` of the binary cross-entropy of the bag label
    against the bag's highest instance probability (log max p = max log p)."""
    bags, idx, local = chunk
    logp = F.log_softmax(model.logits(data.x[idx], g), dim=-1)  # (M, n, 2)
    log_max = _segment_max(logp[..., 1], local, bags.numel()).clamp(max=0.0)  # (M, b)
    log_none = torch.log1p(-torch.exp(log_max).clamp(max=1.0 - PROB_EPS))
    y = bag_y[bags].to(log_max.dtype)
    bce = -(y * log_max + (1 - y) * log_none)
    w = data.bag_weight[:, bags]
    return (bce * w).sum(1) / w.sum(1).clamp_min(1.0)


def fit_stacked_milssl(data: StackedData, *, lr: Sequence[float], weight_decay: Sequence[float],
                       dropout: Sequence[float], mu: Sequence[float], ramp_epochs: Sequence[int],
                       hidden_dims: Sequence[int] = (256,), batch_size: int = 512, lam: float = 25.0,
                       fixed_mu: bool = False, soft_labels: bool = True, local_constraint: bool = True,
                       global_constraint: bool = True, class_balanced: bool = False, warmup_epochs: int = 0,
                       bag_balanced: Sequence[bool] | bool = False, pseudo_negative_weight: float = 1.0,
                       bag_loss_weight: float = 0.0, target_momentum: float = 0.0, neighbours: int = 0,
                       input_noise: float = 0.0, weight_average_epochs: float = 0.0, mixup: float = 0.0,
                       cross_fit: bool = False, per_bag_mu: bool = False, rff_dim: int = 0, confidence_power: float = 0.0,
                       rank_gauss_inputs: bool = False, eval_at: Sequence[int],
                       eval_sets: dict[str, InstanceSet], seeds: Sequence[int],
                       seed: int = 0) -> dict[str, dict[int, np.ndarray]]:
    """Train M MIL-SSL instance classifiers at once (model m on the bags ``data.bag_weight[m]``).

    Per epoch (as :func:`wsi_milssl.mil.selftrain.fit` with ``refresh_every=0``): μ_t of eq. 10 per model
    (``fixed_mu`` skips the ramp), pseudo labels of the model's positive-bag instances from its eval-mode
    probabilities (:func:`stacked_pseudo_labels`), then one pass over all instances in a seeded random
    order, ``batch_size`` per step, soft cross-entropy (eq. 9) averaged over the model's own instances.

    Options beyond the paper: ``class_balanced`` weighs the positive and negative parts of the loss so
    each carries half of it (from the current targets); ``warmup_epochs`` W trains the first W epochs
    with every positive-bag instance labelled 1 before the first refresh; ``bag_balanced`` (one flag, or
    one per model) weighs every instance by 1 / its bag's size, so each bag carries the same share of the
    loss (as in the bag-level baselines) instead of large bags dominating it; ``pseudo_negative_weight``
    scales the negative term of positive-bag instances (``TrainConfig.pseudo_negative_weight``);
    ``bag_loss_weight`` β > 0 adds β times a bag-level term to every step: the binary cross-entropy of the
    bag label against the bag's highest instance probability (eq. 11, as max-pooling MIL trains), over a
    chunk of the model's training bags (every bag once per epoch, chunks in a seeded random order);
    ``target_momentum`` α > 0 averages the pseudo labels over refreshes: after the first refresh the
    targets are T_t = α T_{t-1} + (1 - α) Q_t (an exponential moving average of the refreshes);
    ``neighbours`` k > 0 smooths P before every refresh: a positive-bag instance's probability becomes
    the mean over itself and its k nearest positive-bag instances among the model's own training
    instances (:func:`neighbour_graphs`); ``input_noise`` σ > 0 adds N(0, σ²) to every standardised
    feature of every training step (not to the refreshes or evaluations); ``weight_average_epochs`` h > 0
    refreshes and evaluates with an exponential moving average of the weights over about h epochs of
    steps (:class:`_WeightAverage`) instead of the last step's weights; ``mixup`` α > 0 trains every step
    on convex combinations of the batch's instances with a shuffled copy of it (mixup: weight l ~ Beta(α, α)
    per pair, features and targets mixed alike; a pair counts for model m only when both instances are
    among its training instances, so held-out instances never shape a model); ``cross_fit`` takes every
    refresh's P out of sample: each model's training bags are split in two halves (stratified, seeded),
    two helper models train on one half each (with the same settings, their pseudo labels cross-fitted
    the same way), and a positive-bag instance's P comes from the helper that never trained on its bag
    (:func:`_cross_fit_halves`; three times the training; the helpers only give P); ``per_bag_mu`` makes
    the fraction μ of positive pseudo labels hold in every positive bag (:func:`stacked_pseudo_labels`);
    ``rff_dim`` R > 0 feeds the classifier R random Fourier features of a Gaussian kernel on the standardised
    features (a local, kernel-like input, as the kernel MIL methods that do well on MUSK use) instead of
    the features themselves; ``confidence_power`` γ > 0 weighs every positive-bag instance's loss by
    |2 q - 1|^γ, its pseudo label's confidence (self-paced: an instance the refresh leaves near 0.5 counts
    little, one the local constraint or the transport sets near 0 or 1 fully; negative-bag instances keep
    weight 1); ``rank_gauss_inputs`` standardises every feature by its rank among the model's training
    values (:func:`rank_gauss`, a quantile transform to normal scores) instead of by its mean and std.

    Returns ``{set name: {epoch: instance probabilities (M, N_set) float64}}`` (``"train"`` included).
    """
    m = data.n_models
    for name, seq in (("lr", lr), ("weight_decay", weight_decay), ("dropout", dropout), ("mu", mu),
                      ("ramp_epochs", ramp_epochs), ("seeds", seeds)):
        if len(seq) != m:
            raise ConfigError(f"{name} needs one value per model ({m}); got {len(seq)}.")
    if not bag_loss_weight >= 0:
        raise ConfigError(f"bag_loss_weight must be >= 0 (0 = no bag-level term); got {bag_loss_weight!r}.")
    if isinstance(neighbours, bool) or not isinstance(neighbours, (int, np.integer)) or neighbours < 0:
        raise ConfigError(f"neighbours must be an integer >= 0 (0 = no smoothing of P); got {neighbours!r}.")
    if not 0 <= target_momentum < 1:
        raise ConfigError(f"target_momentum must be in [0, 1) (0 = each refresh alone); got {target_momentum!r}.")
    if not input_noise >= 0:
        raise ConfigError(f"input_noise must be >= 0 (the std of the noise on standardised features; 0 = none); "
                          f"got {input_noise!r}.")
    if not weight_average_epochs >= 0:
        raise ConfigError(f"weight_average_epochs must be >= 0 (0 = the last weights); got {weight_average_epochs!r}.")
    if not mixup >= 0:
        raise ConfigError(f"mixup must be >= 0 (the Beta(α, α) of the mixing weights; 0 = no mixup); got {mixup!r}.")
    if not confidence_power >= 0:
        raise ConfigError(f"confidence_power must be >= 0 (0 = every pseudo label counts fully); got {confidence_power!r}.")
    if cross_fit:
        if neighbours:
            raise ConfigError("cross_fit and neighbours cannot be combined; set one of them.")
        main = m
        halves = _cross_fit_halves(data, seed)  # (M, B): 1 or 2 for a model's training bags, 0 elsewhere
        data = StackedData(x=data.x, bag_ids=data.bag_ids, bag_labels=data.bag_labels,
                           bag_weight=torch.cat([data.bag_weight, (halves == 1).float(), (halves == 2).float()]))
        three = lambda seq: list(seq) * 3  # noqa: E731  (the helpers take their model's settings)
        lr, weight_decay, dropout, mu, ramp_epochs = (three(v) for v in (lr, weight_decay, dropout, mu, ramp_epochs))
        if not isinstance(bag_balanced, (bool, np.bool_)):
            bag_balanced = three(bag_balanced)
        seeds = list(seeds) + [_seed(8, s, k) for k in (1, 2) for s in seeds]
        m = data.n_models
    mean, std = data.standardisation()
    gens = [_gen(4, s) for s in seeds]
    rff = None
    if rff_dim:  # Gaussian kernel of width sqrt(D) on the standardised features (γ = 1 / (2D)), shared by the models
        d = int(data.x.shape[1])
        g_rff = _gen(10, seed)
        rff = (torch.randn(d, int(rff_dim), generator=g_rff) / math.sqrt(d),
               torch.rand(int(rff_dim), generator=g_rff) * 2 * math.pi)
    model = _StackedHead(int(data.x.shape[1]), hidden_dims=hidden_dims, dropout=torch.tensor(list(dropout)), rff=rff,
                         mean=mean, std=std, gens=gens,
                         quantiles=data.sorted_training_values() if rank_gauss_inputs else None)
    opt = _Adam(model.params, torch.tensor(list(lr)), torch.tensor(list(weight_decay)))
    n = int(data.x.shape[0])
    average = (_WeightAverage(model.layers, weight_average_epochs, math.ceil(n / batch_size))
               if weight_average_epochs > 0 else None)
    use = lambda: average.layers if average is not None else None  # noqa: E731  (weights of refresh/eval)
    noise = torch.full((m,), float(input_noise)) if input_noise > 0 else None
    inst_w = data.instance_weight()  # (M, N)
    pos_bag = (data.bag_labels[data.bag_ids] == 1)
    pos_mask = inst_w.bool() & pos_bag[None, :]
    loss_w = instance_loss_weights(data, bag_balanced)
    neg_w = torch.where(pos_bag, float(pseudo_negative_weight), 1.0).float()  # (N,)
    pos_idx = torch.nonzero(pos_bag).flatten()
    graphs = neighbour_graphs(data, pos_idx, neighbours) if neighbours > 0 else []
    pos_local_bags = torch.unique(data.bag_ids[pos_idx], return_inverse=True)[1]
    source = None  # cross_fit: (M, n_pos) the model whose P each model's positive-bag instance takes
    if cross_fit:
        half = halves[:, data.bag_ids[pos_idx]]  # (main, n_pos)
        group = torch.arange(main)[:, None]
        other = torch.where(half == 1, 2 * main + group, torch.where(half == 2, main + group, group))
        source = other.repeat(3, 1)
    mu_t = torch.tensor(list(mu), dtype=torch.float64)
    ramp = torch.tensor(list(ramp_epochs), dtype=torch.float64)
    targets = torch.zeros(m, n)
    if bag_loss_weight > 0:  # every training bag once per epoch, spread over the epoch's steps
        n_bags = int(data.bag_labels.numel())
        grouped = _group(data.bag_ids, n_bags)
        bags_per_step = max(1, math.ceil(n_bags / max(1, math.ceil(n / batch_size))))
        bag_y = data.bag_labels.double()
    sets = {"train": data.x}
    for name, s in eval_sets.items():
        sets[name] = torch.from_numpy(np.ascontiguousarray(s.features, dtype=np.float32))
    wanted = sorted({int(e) for e in eval_at})
    out: dict[str, dict[int, np.ndarray]] = {name: {} for name in sets}
    for epoch in range(max(wanted)):
        if epoch < warmup_epochs:
            targets = pos_mask.float()
        elif pos_idx.numel():
            if fixed_mu:
                mus = mu_t
            else:
                frac = torch.where(ramp > 0, (epoch / ramp.clamp_min(1.0)).clamp(max=1.0), torch.ones_like(ramp))
                mus = 0.5 + (mu_t - 0.5) * frac
            p = model.probs(data.x[pos_idx], layers=use())
            if source is not None:
                p = p.gather(0, source)
            for models, members, near in graphs:  # P smoothed over each model's own neighbours
                rows, cols = models[:, None], members[None, :]
                p[rows, cols] = p[rows, cols][:, near].mean(2)
            q = stacked_pseudo_labels(p, pos_mask[:, pos_idx], pos_local_bags, mu=mus, lam=lam, soft=soft_labels,
                                      local_constraint=local_constraint, global_constraint=global_constraint,
                                      per_bag=per_bag_mu)
            if target_momentum > 0 and epoch > warmup_epochs:  # pseudo labels averaged over refreshes
                q = target_momentum * targets[:, pos_idx] + (1 - target_momentum) * q
            targets = torch.zeros(m, n)
            targets[:, pos_idx] = q
        if class_balanced:
            tw = loss_w  # the weights the loss uses, so each class carries half of that loss
            pos_mass = (targets * tw).sum(1, keepdim=True).clamp_min(1e-6)
            neg_mass = ((1 - targets) * tw).sum(1, keepdim=True).clamp_min(1e-6)
            total = tw.sum(1, keepdim=True)
            w_pos, w_neg = 0.5 * total / pos_mass, 0.5 * total / neg_mass
        order = torch.randperm(n, generator=_gen(5, seed, epoch))
        g = _gen(6, seed, epoch)
        bag_chunks = (list(_bag_batches(torch.randperm(n_bags, generator=_gen(7, seed, epoch)), grouped,
                                        bags_per_step)) if bag_loss_weight > 0 else [])
        for step, i in enumerate(range(0, n, batch_size)):
            idx = order[i:i + batch_size]
            x, q, w, nw = data.x[idx], targets[:, idx], loss_w[:, idx], neg_w[idx]
            if confidence_power > 0 and epoch >= warmup_epochs:  # uncertain pseudo labels count less
                w = torch.where(pos_bag[idx], (2 * q - 1).abs() ** confidence_power, torch.ones_like(q)) * w
            if mixup > 0:  # pairs (j, perm[j]) mixed with weight l_j; a pair counts where both are a model's own
                perm = torch.randperm(idx.numel(), generator=g)
                mix = _beta(mixup, idx.numel(), g)
                x = mix[:, None] * x + (1 - mix[:, None]) * x[perm]
                q = mix * q + (1 - mix) * q[:, perm]
                nw = mix * nw + (1 - mix) * nw[perm]
                own = (inst_w[:, idx] > 0) & (inst_w[:, idx[perm]] > 0)
                w = torch.where(own, mix * w + (1 - mix) * w[:, perm], torch.zeros_like(w))
            logp = F.log_softmax(model.logits(x, g, noise=noise), dim=-1)  # (M, b, 2)
            negative = nw * (1 - q) * logp[..., 0]
            if class_balanced:
                ce = -(w_pos * q * logp[..., 1] + w_neg * negative)
            else:
                ce = -(q * logp[..., 1] + negative)
            per_model = (ce * w).sum(1) / w.sum(1).clamp_min(1e-6)
            if step < len(bag_chunks):
                per_model = per_model + bag_loss_weight * _max_bag_loss(model, data, bag_chunks[step], bag_y, g)
            per_model.sum().backward()
            opt.step()
            if average is not None:
                average.update(model.layers)
        if epoch + 1 in wanted:
            for name, x in sets.items():
                out[name][epoch + 1] = model.probs(x, layers=use()).double().numpy()
            if not np.isfinite(out["train"][epoch + 1]).all():
                raise ConfigError("MIL-SSL training diverged (non-finite probabilities). Fix: lower the learning rate "
                                  "or check the features for extreme values.")
    if cross_fit:
        out = {name: {e: v[:main] for e, v in by_epoch.items()} for name, by_epoch in out.items()}
    return out


def _cross_fit_halves(data: StackedData, seed: int) -> torch.Tensor:
    """int64 (M, B): each model's training bags split in two halves, 1 and 2 (0 for bags it does not train
    on); within a model the positive and the negative bags are each dealt alternately in a seeded random
    order, so both halves hold both classes."""
    halves = torch.zeros(data.bag_weight.shape, dtype=torch.int64)
    for k in range(data.n_models):
        order = torch.randperm(data.bag_weight.shape[1], generator=_gen(9, seed, k))
        for label in (0, 1):
            mine = order[(data.bag_weight[k, order] > 0) & (data.bag_labels[order] == label)]
            halves[k, mine] = 1 + torch.arange(mine.numel()) % 2
    return halves
