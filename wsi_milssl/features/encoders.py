"""Frozen patch encoders behind a registry: ``@register_encoder("name")`` and ``create_encoder(name, ...)``.

An :class:`Encoder` maps normalised float (B, 3, H, W) patches to float (B, D) features. Built in:

- ``resnet50_trunc``: torchvision's ResNet50 truncated after ``layer3`` with adaptive average pooling,
  1024-d: CLAM's ``resnet50_trunc`` (:mod:`wsi_milssl.features.resnet`, no torchvision import). ImageNet
  normalisation, any input size.
- ``resnet18``: torchvision's ResNet18 without its classifier, 512-d (:mod:`wsi_milssl.mil.resnet`).
  A wsi-milssl training checkpoint of a ResNet18 (``RUN/best.pt``) loads as its weights too.
- ``timm:NAME``: any model of the optional package timm (``pip install 'wsi-milssl[timm]'``), built
  with ``timm.create_model(NAME, pretrained=False, num_classes=0, **kwargs)``; normalisation and input
  size from its ``pretrained_cfg``. Hub names (``hf-hub:...``) are refused: they fetch files at run time.

Weights (``weights=``), never downloaded:

- a local file (``.pth``/``.pt``/``.bin`` state dict, a checkpoint holding one under ``state_dict`` or
  ``model``, or ``.safetensors``), read by the rules of :mod:`wsi_milssl.weights` (``weights_only=True``
  only; the wrapper prefixes ``module.``, ``model.``, ``encoder.`` and ``backbone.``, also stacked, are
  stripped), so CLAM's and DataParallel checkpoints load as they are. A foundation model's checkpoint,
  e.g. UNI: ``--encoder timm:vit_large_patch16_224 --encoder-kwargs '{"init_values": 1e-5,
  "dynamic_img_size": true}' --weights /models/uni/pytorch_model.bin``.
- ``"cached"``: the file the library's own download would have left, if it is there: torchvision's
  ``$TORCH_HOME/hub/checkpoints/`` (``resnet50-0676ba61.pth``, ``resnet18-f37072fd.pth``, ...) or
  timm's Hugging Face cache (``$HF_HOME/hub``; ``timm/resnet50.tv_in1k`` for ``resnet50_trunc``).
- ``"random"``: a fixed random initialisation (seed 0), for tests and speed measurements only.

Every tensor of the encoder must come from the file and every tensor of the file must fit the encoder
(a CheckpointError names the first that do not); tensors of parts the encoder drops (``fc``,
``layer4``, classifier heads) are skipped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from wsi_milssl import hashing
from wsi_milssl.errors import CheckpointError, ConfigError
from wsi_milssl.registry import Registry
from wsi_milssl.weights import read_state_dict, strip_prefixes

__all__ = [
    "ENCODERS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Encoder",
    "EncoderWeightsError",
    "register_encoder",
    "create_encoder",
    "list_encoders",
    "load_weights_file",
    "torch_cache_dir",
]

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Prefix of encoder names built by timm.
TIMM_PREFIX = "timm:"
#: The seed of ``weights="random"`` (the same random encoder in every run, so runs can resume).
RANDOM_SEED = 0


@dataclass(frozen=True, eq=False)
class Encoder:
    """A frozen patch encoder.

    ``module``: eval mode, no gradients; normalised float (B, 3, H, W) -> float (B, ``dim``).
    ``mean``/``std``: the per-channel input normalisation of [0, 1] RGB values. ``input_size_px``: the
    patch side the module needs (None: any). ``weights``: the file the weights came from, or 'random';
    ``weights_sha256``: that file's SHA-256 (provenance, and part of a feature run's settings).
    ``kwargs``: extra construction arguments (timm models).
    """

    name: str
    module: nn.Module
    dim: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    input_size_px: int | None = None
    weights: str = "random"
    weights_sha256: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts recorded in every feature file and in ``features_config.json``."""
        return {"encoder": self.name, "encoder_kwargs": dict(self.kwargs), "feature_dim": int(self.dim),
                "encoder_weights": self.weights, "encoder_weights_sha256": self.weights_sha256,
                "normalisation": {"mean": list(self.mean), "std": list(self.std)},
                "encoder_input_size_px": self.input_size_px}


#: name -> factory(*, weights: str, **kwargs) -> Encoder
ENCODERS: Registry[Callable[..., Encoder]] = Registry("encoder")


def register_encoder(name: str):
    """Register an encoder factory ``fn(*, weights: str, **kwargs) -> Encoder`` under ``name`` (decorator);
    ``weights`` is a file path, 'cached' or 'random'."""
    return ENCODERS.register(name)


def list_encoders() -> list[str]:
    """The registered encoder names and the ``timm:NAME`` form, for help texts."""
    return ENCODERS.names() + [f"{TIMM_PREFIX}NAME"]


def create_encoder(name: str, *, weights: str | os.PathLike = "cached", kwargs: Mapping[str, Any] | None = None
                   ) -> Encoder:
    """Build the encoder ``name`` with ``weights`` (a file, 'cached' or 'random'; see the module docstring)
    in eval mode with gradients off. Raises ConfigError for an unknown name, a missing optional package
    or weights that are not there, and CheckpointError for a file that does not fit the encoder."""
    weights = str(weights)
    kwargs = dict(kwargs or {})
    if name.startswith(TIMM_PREFIX):
        encoder = _timm_encoder(name[len(TIMM_PREFIX):], weights=weights, kwargs=kwargs)
    else:
        encoder = ENCODERS.get(name)(weights=weights, **kwargs)
    encoder.module.eval().requires_grad_(False)
    return encoder


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

def torch_cache_dir() -> Path:
    """Where torchvision (``torch.hub``) keeps downloaded weights: ``$TORCH_HOME/hub/checkpoints``."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def _hf_cached(repo_id: str, filenames: tuple[str, ...]) -> Path | None:
    """A file of ``repo_id`` in the Hugging Face cache, without any network access (None if absent or
    huggingface_hub is not installed)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename)
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    return None


def _random_or_file(weights: str, *, name: str, cached: list[Path], looked: str) -> Path | None:
    """None for 'random'; the first existing file of ``cached`` for 'cached'; else ``weights`` as a path."""
    if weights == "random":
        return None
    if weights == "cached":
        for path in cached:
            if path.is_file():
                return path
        raise EncoderWeightsError(f"encoder {name!r}: no downloaded weights found in the library's cache ({looked}), "
                                  "and nothing is downloaded at run time.", kind="cached")
    path = Path(os.path.expanduser(weights))
    if path.is_dir():
        raise EncoderWeightsError(f"{path}: is a folder, not a weights file (encoder {name!r}).", kind="folder")
    if not path.is_file():
        raise EncoderWeightsError(f"{path}: weights file not found (encoder {name!r}).", kind="missing")
    return path


def _encoder_weights_error(problem: str, kind: str) -> "EncoderWeightsError":
    return EncoderWeightsError(problem, kind=kind)


class EncoderWeightsError(ConfigError):
    """ConfigError for encoder weights that are not there: ``kind`` "cached" (none in the library's cache),
    "folder" (a folder given) or "missing" (no such file). ``problem`` says what is wrong; :meth:`fix` how to
    give the weights: with ``wsi-milssl features --weights`` (the message), or ``setting=True`` with a
    pipeline's ``[features] weights`` (``wsi-milssl run`` checks them before its first stage)."""

    def __init__(self, problem: str, *, kind: str) -> None:
        self.problem, self.kind = problem, kind
        super().__init__(f"{problem} Fix: {self.fix()}")

    def __reduce__(self):  # pickled (from a worker process) with its keyword argument
        return _encoder_weights_error, (self.problem, self.kind)

    def fix(self, *, setting: bool = False) -> str:
        if not setting:
            return {"cached": "pass --weights PATH to a local weights file (download it once yourself, e.g. from the "
                              "model's page), put it in that cache, or use --weights random for speed tests only.",
                    "folder": "pass the weights file in it (a state dict, .pth/.bin/.safetensors) with --weights.",
                    "missing": "pass the path of a local state dict with --weights, or --weights cached / random.",
                    }[self.kind]
        relative = f"a relative path is resolved against the current folder, {Path.cwd()}"
        return {"cached": "set [features] weights to a local weights file (weights = \"PATH\", or --set "
                          "features.weights=PATH; download it once yourself, e.g. from the model's page), put it in "
                          "that cache, or set weights = \"random\" for speed tests only.",
                "folder": "set [features] weights to the weights file in it (a state dict, .pth/.bin/.safetensors; "
                          f"--set features.weights=PATH; {relative}).",
                "missing": f"set [features] weights to the path of a local state dict (--set features.weights=PATH; "
                           f"{relative}), or to \"cached\" / \"random\".",
                }[self.kind]


def load_weights_file(module: nn.Module, path: str | os.PathLike, *, name: str,
                      skip: tuple[str, ...] = ()) -> None:
    """Load the state dict in ``path`` into ``module``: every tensor of the module must be in the file
    with its shape, and every tensor of the file must be the module's, except those under the prefixes
    in ``skip`` (parts the encoder drops: classifier heads, ``layer4``); CheckpointError naming the
    first few otherwise. BatchNorm's ``num_batches_tracked`` counters may be missing (older torchvision
    files lack them; they do not change the output). Weights with NaN or infinity are refused."""
    path = Path(path)
    own = module.state_dict()
    state = strip_prefixes(read_state_dict(path), set(own))
    for k in own:
        if k.endswith(".num_batches_tracked") and k not in state:
            state[k] = own[k]
    bad = [k for k in own if k not in state or tuple(state[k].shape) != tuple(own[k].shape)]
    if bad:
        detail = ", ".join(f"{k} {'missing' if k not in state else f'{tuple(state[k].shape)} != {tuple(own[k].shape)}'}"
                           for k in bad[:4])
        raise CheckpointError(
            f"{path}: these weights do not fit encoder {name!r} ({len(bad)} of {len(own)} tensors missing or "
            f"mis-shaped: {detail}{' ...' if len(bad) > 4 else ''}). Fix: pass the weights of this architecture "
            "(and for timm models the --encoder-kwargs it was trained with).")
    extra = [k for k in state if k not in own and not k.startswith(skip)]
    if extra:
        raise CheckpointError(
            f"{path}: {len(extra)} tensors of these weights have no place in encoder {name!r} ({', '.join(extra[:3])}"
            f"{' ...' if len(extra) > 3 else ''}), so it is not the network they were trained in. Fix: for timm "
            "models pass the --encoder-kwargs the checkpoint was made with (e.g. init_values), or the matching "
            "--encoder.")
    non_finite = [k for k in own if state[k].is_floating_point() and not bool(torch.isfinite(state[k]).all())]
    if non_finite:
        raise CheckpointError(
            f"{path}: {len(non_finite)} tensors of these weights hold NaN or infinity ({', '.join(non_finite[:3])}"
            f"{' ...' if len(non_finite) > 3 else ''}), so every feature would be NaN. Fix: pass the weights of a "
            "model that trained without diverging (or an earlier checkpoint of it).")
    module.load_state_dict({k: state[k] for k in own}, strict=True)


class _Seeded:
    """Build modules under a fixed torch seed without touching the caller's random state."""

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        torch.manual_seed(RANDOM_SEED)

    def __exit__(self, *exc):
        return self._fork.__exit__(*exc)


def _no_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    if kwargs:
        raise ConfigError(f"encoder {name!r} takes no encoder kwargs; got {json.dumps(dict(kwargs))}.")


def _finish(name: str, module: nn.Module, dim: int, weights: str, path: Path | None, *,
            skip: tuple[str, ...], **extra) -> Encoder:
    if path is not None:
        load_weights_file(module, path, name=name, skip=skip)
    return Encoder(name=name, module=module, dim=dim, weights="random" if path is None else str(path.resolve()),
                   weights_sha256=None if path is None else hashing.cached_file_sha256(path), **extra)


# ----------------------------------------------------------------------------------------------
# Built-in encoders
# ----------------------------------------------------------------------------------------------

@register_encoder("resnet50_trunc")
def resnet50_trunc(*, weights: str = "cached", **kwargs) -> Encoder:
    """torchvision's ResNet50 up to ``layer3`` + adaptive average pooling: 1024-d (CLAM's encoder)."""
    from wsi_milssl.features.resnet import TRUNK_DIM, ResNet50

    _no_kwargs("resnet50_trunc", kwargs)
    cache = torch_cache_dir()
    candidates = [cache / n for n in ("resnet50-0676ba61.pth", "resnet50-19c8e357.pth", "resnet50-11ad3fa6.pth")]
    hub = _hf_cached("timm/resnet50.tv_in1k", ("model.safetensors", "pytorch_model.bin")) if weights == "cached" else None
    path = _random_or_file(weights, name="resnet50_trunc", cached=candidates + ([hub] if hub else []),
                           looked=f"{cache}/resnet50-*.pth, Hugging Face cache timm/resnet50.tv_in1k")
    with _Seeded():
        module = ResNet50(trunk=True)
    return _finish("resnet50_trunc", module, TRUNK_DIM, weights, path, skip=("layer4.", "fc."))


@register_encoder("resnet18")
def resnet18(*, weights: str = "cached", **kwargs) -> Encoder:
    """torchvision's ResNet18 without its classifier (average-pooled ``layer4``): 512-d."""
    from wsi_milssl.mil.resnet import ResNet18

    _no_kwargs("resnet18", kwargs)
    cache = torch_cache_dir()
    path = _random_or_file(weights, name="resnet18",
                           cached=[cache / n for n in ("resnet18-f37072fd.pth", "resnet18-5c106cde.pth")],
                           looked=f"{cache}/resnet18-*.pth")
    with _Seeded():
        module = ResNet18(num_classes=1)
    module.fc = nn.Identity()
    return _finish("resnet18", module, 512, weights, path, skip=("fc.",))


# ----------------------------------------------------------------------------------------------
# timm (optional)
# ----------------------------------------------------------------------------------------------

_HEAD_PREFIXES = ("head.", "head_dist.", "fc.", "classifier.", "last_linear.")


def _import_timm():
    try:
        import timm
    except ImportError:
        raise ConfigError(
            "timm encoders need the optional package timm, which is not installed. Fix: pip install "
            "'wsi-milssl[timm]' (or pip install timm), or use a built-in encoder: "
            f"{', '.join(ENCODERS.names())}.") from None
    return timm


def _timm_encoder(model_name: str, *, weights: str, kwargs: dict[str, Any]) -> Encoder:
    name = f"{TIMM_PREFIX}{model_name}"
    if not model_name or model_name.startswith(("hf-hub:", "hf_hub:", "local-dir:")):
        raise ConfigError(
            f"encoder {name!r}: give a timm architecture name (e.g. timm:vit_large_patch16_224); hub names fetch "
            "files at run time and nothing here downloads. Fix: pass the architecture, its --encoder-kwargs and "
            "--weights PATH to the downloaded checkpoint.")
    timm = _import_timm()
    kwargs = dict(kwargs)
    kwargs.setdefault("num_classes", 0)
    try:
        with _Seeded():
            module = timm.create_model(model_name, pretrained=False, **kwargs)
    except RuntimeError as exc:  # timm: unknown model
        raise ConfigError(f"encoder {name!r}: timm cannot build it ({exc}). Fix: check the name with "
                          "timm.list_models().") from None
    except TypeError as exc:
        raise ConfigError(f"encoder {name!r}: bad --encoder-kwargs {json.dumps(kwargs)} ({exc}).") from None
    cfg = dict(getattr(module, "pretrained_cfg", None) or {})
    cached: list[Path] = []
    looked = []
    if weights == "cached":
        if cfg.get("hf_hub_id"):
            hub = _hf_cached(str(cfg["hf_hub_id"]), ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"))
            cached += [hub] if hub else []
            looked.append(f"Hugging Face cache {cfg['hf_hub_id']}")
        if cfg.get("url"):
            cached.append(torch_cache_dir() / Path(str(cfg["url"])).name)
            looked.append(str(cached[-1]))
    path = _random_or_file(weights, name=name, cached=cached, looked=", ".join(looked) or "timm names no file for it")
    dim = int(getattr(module, "num_features", 0) or 0)
    if dim <= 0:
        raise ConfigError(f"encoder {name!r}: timm reports no feature width (num_features); it cannot embed patches.")
    mean = tuple(float(v) for v in cfg.get("mean", IMAGENET_MEAN))
    std = tuple(float(v) for v in cfg.get("std", IMAGENET_STD))
    if len(mean) != 3 or len(std) != 3:
        raise ConfigError(f"encoder {name!r}: its pretrained_cfg mean/std are not RGB ({mean}, {std}).")
    return _finish(name, module, dim, weights, path, skip=_HEAD_PREFIXES, mean=mean, std=std,
                   input_size_px=_fixed_input_size(module, cfg), kwargs={k: v for k, v in kwargs.items()})


def _fixed_input_size(module: nn.Module, cfg: Mapping[str, Any]) -> int | None:
    """The input side a timm model insists on (vision transformers without dynamic_img_size), else None."""
    embed = getattr(module, "patch_embed", None)
    if embed is None or getattr(embed, "dynamic_img_size", False) or not getattr(embed, "strict_img_size", True):
        return None
    size = getattr(embed, "img_size", None) or cfg.get("input_size", (3, 224, 224))[-2:]
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    if size[0] != size[-1]:
        raise ConfigError(f"timm model with a non-square input {size}; pass dynamic_img_size=true in --encoder-kwargs.")
    return int(size[0])
