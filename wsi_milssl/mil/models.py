"""Instance classifiers behind a registry: ``@register_model("name")`` and ``create_model(name, **kwargs)``.

Every model maps a batch of instances to two logits (column 0 negative, column 1 positive), so the
positive-class probability is ``softmax(logits)[:, 1]``.

- ``resnet18``: ResNet18 from scratch (torchvision's network, built by :mod:`wsi_milssl.mil.resnet`
  without importing torchvision), 2-class head; input float32
  (B, 3, H, W) as made by :func:`wsi_milssl.mil.data.to_tensor`. ``weights_path`` loads a local state
  dict, read as ``features --weights`` reads one (:mod:`wsi_milssl.weights`; an ImageNet checkpoint's
  1000-class head is skipped with a warning). Nothing is downloaded.
- ``linear``: one fully connected layer over (B, D) float32 instance features (the paper's head for
  pre-extracted features).
- ``mlp``: ``hidden_dims`` fully connected ReLU layers with dropout, then the 2-class layer.

Feature heads start with a :class:`Standardize` layer whose per-feature mean and standard deviation are
buffers (set from the training instances by ``fit``), so a saved model carries its own normalisation.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from torch import nn

from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.registry import Registry
from wsi_milssl.weights import read_state_dict, strip_prefixes

__all__ = ["MODELS", "register_model", "create_model", "list_models", "load_state_dict_file", "Standardize",
           "FeatureHead", "is_image_model", "core_module"]

log = logging.getLogger(__name__)

MODELS: Registry[Callable[..., nn.Module]] = Registry("model")
_IMAGE_MODELS: set[str] = set()


def register_model(name: str, *, image: bool = False):
    """Register a model factory under ``name`` (decorator; ValueError when the name is taken by another
    factory). ``image=True`` marks models over patches."""
    register = MODELS.register(name)

    def deco(factory: Callable[..., nn.Module]):
        register(factory)
        if image:
            _IMAGE_MODELS.add(name)
        return factory

    return deco


# Modules that register further built-in models (imported on first use of the registry).
_BUILTIN_MODULES = ("wsi_milssl.benchmark.baselines",)  # digit-cnn


def _load_builtins() -> None:
    import importlib

    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def list_models() -> list[str]:
    """Names of the registered models, sorted."""
    _load_builtins()
    return sorted(MODELS)


def is_image_model(name: str) -> bool:
    """True when the registered model ``name`` takes image patches rather than feature vectors."""
    _load_builtins()
    return name in _IMAGE_MODELS


def core_module(model: torch.nn.Module) -> torch.nn.Module:
    """The network inside a ``torch.compile`` and a DistributedDataParallel wrapper (predictions run on it,
    eager and without collectives)."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def create_model(name: str, **kwargs) -> nn.Module:
    """Build the registered model ``name`` with ``kwargs`` (e.g. ``in_features`` for feature heads)."""
    _load_builtins()
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r}; registered models are {', '.join(list_models())}."
        ) from None
    return factory(**kwargs)


def load_state_dict_file(model: nn.Module, weights_path: str | os.PathLike, *, skip_prefix: str) -> None:
    """Load the tensors of the weights file that fit ``model``, read by the rules of ``features --weights``
    (:mod:`wsi_milssl.weights`: ``weights_only=True``; a state dict, a checkpoint holding one under
    ``state_dict`` or ``model``, or ``.safetensors``; wrapper prefixes stripped). Every tensor of the model
    must come from the file except those under ``skip_prefix`` (the head), which start fresh."""
    weights_path = os.path.expanduser(weights_path)  # as the pipeline's pre-flight check reads it (review BR)
    if not os.path.exists(weights_path):
        raise CheckpointError(f"{weights_path}: weights file not found. Fix: check the path (`train --weights`, or "
                              "[train] weights_path of a pipeline; a relative one is read from the current folder).")
    own = model.state_dict()
    state = strip_prefixes(read_state_dict(weights_path), set(own))
    keep = {}
    skipped = []
    for key, value in state.items():
        if key in own and own[key].shape == value.shape:
            keep[key] = value
        else:
            skipped.append(key)
    missing = [k for k in own if k not in keep]
    bad_missing = [k for k in missing if not k.startswith(skip_prefix)]
    if bad_missing:
        raise CheckpointError(
            f"{weights_path}: weights do not fit the model; missing or mis-shaped: "
            f"{', '.join(bad_missing[:5])}{' ...' if len(bad_missing) > 5 else ''}."
        )
    non_finite = [k for k, v in keep.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if non_finite:
        raise CheckpointError(
            f"{weights_path}: {len(non_finite)} tensors of these weights hold NaN or infinity "
            f"({', '.join(non_finite[:3])}{' ...' if len(non_finite) > 3 else ''}), so training would start from a "
            "broken model. Fix: pass the weights of a model that trained without diverging (or an earlier "
            "checkpoint of it).")
    if skipped:
        log.warning("%s: skipped %d tensors that do not fit (%s); the classification head starts fresh.",
                    weights_path, len(skipped), ", ".join(skipped[:3]))
    model.load_state_dict(keep, strict=False)


@register_model("resnet18", image=True)
def resnet18(*, num_classes: int = 2, weights_path: str | None = None, **_ignored) -> nn.Module:
    """ResNet18 (torchvision's, see :mod:`wsi_milssl.mil.resnet`), random init, ``num_classes`` outputs;
    optional local weights (a torchvision/ImageNet state dict loads as it is)."""
    from wsi_milssl.mil.resnet import ResNet18

    model = ResNet18(num_classes=num_classes)
    if weights_path:
        load_state_dict_file(model, weights_path, skip_prefix="fc.")
    return model


class Standardize(nn.Module):
    """(x - mean) / std with per-feature buffers ``mean`` and ``std`` of shape (D,)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(in_features))
        self.register_buffer("std", torch.ones(in_features))

    def set_stats(self, features: torch.Tensor, *, chunk_rows: int = 1 << 16) -> None:
        """Set mean/std from (N, D) training features (a constant feature keeps std 1), in float64, summed
        ``chunk_rows`` rows at a time: no float64 copy of the whole set (review CH: two of them, each twice the
        size of the float32 features, were the peak of a feature run's memory)."""
        n = max(int(features.shape[0]), 1)
        chunks = torch.split(features, chunk_rows)
        mean = sum(c.double().sum(0) for c in chunks) / n
        var = sum((c.double() - mean).square().sum(0) for c in chunks) / n
        std = var.sqrt()
        std = torch.where(std > 1e-12, std, torch.ones_like(std))
        self.mean.copy_(mean.to(self.mean.dtype))
        self.std.copy_(std.to(self.std.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def hidden_layers(in_features: int, hidden_dims: tuple[int, ...], *, dropout: float = 0.0
                  ) -> tuple[list[nn.Module], int]:
    """[Linear -> ReLU (-> Dropout)] per entry of ``hidden_dims``, and the width they end with."""
    layers: list[nn.Module] = []
    width = in_features
    for h in hidden_dims:
        layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    return layers, width


class FeatureHead(nn.Module):
    """Standardize -> [Linear -> ReLU -> Dropout] * len(hidden_dims) -> Linear(num_classes)."""

    def __init__(self, in_features: int, *, hidden_dims: tuple[int, ...] = (), dropout: float = 0.0,
                 num_classes: int = 2) -> None:
        super().__init__()
        self.standardize = Standardize(in_features)
        layers, width = hidden_layers(in_features, hidden_dims, dropout=dropout)
        layers.append(nn.Linear(width, num_classes))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.standardize(x))


def _need_in_features(name: str, in_features) -> int:
    if not isinstance(in_features, int) or in_features < 1:
        raise ConfigError(f"model {name!r} needs in_features (the feature-vector length) >= 1; got {in_features!r}.")
    return in_features


@register_model("linear")
def linear(*, in_features: int | None = None, num_classes: int = 2, weights_path: str | None = None,
           **_ignored) -> nn.Module:
    """A single fully connected layer over standardised features."""
    model = FeatureHead(_need_in_features("linear", in_features), num_classes=num_classes)
    if weights_path:
        load_state_dict_file(model, weights_path, skip_prefix="\0")
    return model


@register_model("mlp")
def mlp(*, in_features: int | None = None, hidden_dims: tuple[int, ...] | list[int] = (256,),
        dropout: float = 0.0, num_classes: int = 2, weights_path: str | None = None, **_ignored) -> nn.Module:
    """A small multilayer perceptron over standardised features."""
    model = FeatureHead(_need_in_features("mlp", in_features), hidden_dims=tuple(hidden_dims),
                        dropout=float(dropout), num_classes=num_classes)
    if weights_path:
        load_state_dict_file(model, weights_path, skip_prefix="\0")
    return model
