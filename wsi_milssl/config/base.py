"""Validation helpers shared by every stage's frozen config dataclass, and resolved-config output.

Each stage config is a ``@dataclass(frozen=True)`` whose ``__post_init__`` calls these helpers, so a
wrong value fails on construction with a message naming the field, the allowed values and what was
given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping

from wsi_milssl.errors import ConfigError

__all__ = [
    "check_choice",
    "check_inference_runtime",
    "check_range",
    "check_type",
    "coerce_float_fields",
    "config_to_dict",
    "config_hash",
    "config_from_mapping",
    "load_toml",
    "write_resolved_config",
]


def _where(cls_name: str, field: str) -> str:
    return f"{cls_name}.{field}"


def check_type(cls_name: str, field: str, value: Any, types: type | tuple[type, ...]) -> None:
    """Raise ConfigError unless ``value`` is an instance of ``types`` (bool is never an int here)."""
    types_t = types if isinstance(types, tuple) else (types,)
    bad_bool = isinstance(value, bool) and bool not in types_t
    if bad_bool or not isinstance(value, types_t):
        names = " or ".join(t.__name__ for t in types_t)
        kind = type(value)
        got = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        raise ConfigError(  # numpy.bool, not 'bool': np.True_ is no bool
            f"{_where(cls_name, field)} must be {names}; got {value!r} ({got})."
        )


#: field annotations (as strings: the config modules use ``from __future__ import annotations``) that hold a float
_FLOAT_ANNOTATIONS = {"float", "float | None", "tuple[float, ...]", "tuple[float, ...] | None"}


def coerce_float_fields(config: Any) -> None:
    """Make an int given for a float field of a (frozen) config dataclass a float, in tuples too (``10`` ->
    ``10.0``), so that ``magnification = 10`` and ``10.0`` make equal configs, the same JSON and the same
    digests; bools are left alone (a bool is no number here), and other values for the checks to refuse."""

    def as_float(value: Any) -> Any:
        return float(value) if type(value) is int else value

    for f in dataclasses.fields(config):
        if str(f.type) not in _FLOAT_ANNOTATIONS:
            continue
        value = getattr(config, f.name)
        value = tuple(as_float(v) for v in value) if isinstance(value, tuple) else as_float(value)
        object.__setattr__(config, f.name, value)


def check_range(
    cls_name: str,
    field: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
    """Raise ConfigError unless ``low <= value <= high`` (bounds optional, inclusivity selectable)."""
    check_type(cls_name, field, value, (int, float))
    ok = True
    if low is not None:
        ok &= value >= low if low_inclusive else value > low
    if high is not None:
        ok &= value <= high if high_inclusive else value < high
    if not ok:
        lo = "" if low is None else f"{low} {'<=' if low_inclusive else '<'} "
        hi = "" if high is None else f" {'<=' if high_inclusive else '<'} {high}"
        raise ConfigError(f"{_where(cls_name, field)} must satisfy {lo}value{hi}; got {value!r}.")


#: The level-0 µm/px a slide may be given or measured at (every stage's slide_mpp, evaluate's mpp and froc_mpp,
#: info's --slide-mpp and --mpp-at-40x)
SLIDE_MPP_RANGE = (0.01, 100.0)


def check_slide_mpp(cls_name: str, field: str, value: float) -> None:
    """Raise ConfigError unless ``value`` is in :data:`SLIDE_MPP_RANGE`."""
    check_range(cls_name, field, value, low=SLIDE_MPP_RANGE[0], high=SLIDE_MPP_RANGE[1])


#: CAMELYON16's annotation groups (ASAP ``PartOfGroup``, QuPath classification), matched without case
DEFAULT_TUMOR_GROUPS = ("_0", "_1", "Tumor")
DEFAULT_NON_TUMOR_GROUPS = ("_2", "Exclusion", "None")


def check_groups(config: Any) -> None:
    """Check (and make tuples of) ``config.tumor_groups`` / ``non_tumor_groups``: non-empty names, at least
    one tumour group, no group in both (the rule of every config that reads annotations)."""
    name = type(config).__name__
    for field in ("tumor_groups", "non_tumor_groups"):
        value = getattr(config, field)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(config, field, value)
        check_type(name, field, value, tuple)
        bad = [v for v in value if not isinstance(v, str) or not v.strip()]
        if bad:
            raise ConfigError(f"{name}.{field} must hold non-empty group names; got {bad!r}.")
    if not config.tumor_groups:
        raise ConfigError(f"{name}.tumor_groups must name at least one group; got an empty tuple.")
    both = sorted({g.strip().casefold() for g in config.tumor_groups}
                  & {g.strip().casefold() for g in config.non_tumor_groups})
    if both:
        default = (" (non_tumor_groups are the default ones, " + ", ".join(DEFAULT_NON_TUMOR_GROUPS)
                   + ": set them too, e.g. --non-tumor-groups)"
                   if tuple(config.non_tumor_groups) == DEFAULT_NON_TUMOR_GROUPS else "")
        raise ConfigError(f"{name}: group(s) {', '.join(both)} are in both tumor_groups and non_tumor_groups"
                          f"{default}; list each group once.")


def check_choice(cls_name: str, field: str, value: Any, choices: Iterable[Any], *, registry: str | None = None
                 ) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``; ``registry`` (e.g. "register_model"): the
    choices are a registry's, and the error says where a part registered by the caller's code is known."""
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        hint = (f" A name registered with {registry} in your own code is known only in a Python process that has "
                "imported that code (not on the command line)." if registry else "")
        raise ConfigError(f"{_where(cls_name, field)} must be one of {allowed}; got {value!r}.{hint}")


def check_inference_runtime(config: Any) -> None:
    """Check the runtime fields that the stages running a model over patch stores share (``features``,
    ``heatmap``): batch_size, num_workers, device, amp, channels_last, fuse_batchnorm, decode, threads."""
    name = type(config).__name__
    check_type(name, "batch_size", config.batch_size, int)
    check_range(name, "batch_size", config.batch_size, low=0, high=65536)  # 0: auto, per device
    check_type(name, "num_workers", config.num_workers, int)
    check_range(name, "num_workers", config.num_workers, low=-1, high=256)
    check_choice(name, "device", config.device, ("auto", "cpu", "cuda"))
    check_choice(name, "amp", config.amp, ("auto", "off", "bf16", "fp16"))
    check_type(name, "channels_last", config.channels_last, bool)
    check_type(name, "fuse_batchnorm", config.fuse_batchnorm, bool)
    check_choice(name, "decode", config.decode, ("workers", "device"))
    check_type(name, "threads", config.threads, int)
    check_range(name, "threads", config.threads, low=0, high=1024)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON-serialisable dict of a (nested) config dataclass."""
    return _plain(config)


def config_hash(config: Any, *, exclude: Iterable[str] = ()) -> str:
    """A short stable SHA-256 of the config's JSON form, leaving out fields in ``exclude``."""
    data = config_to_dict(config)
    for key in exclude:
        data.pop(key, None)
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def did_you_mean(unknown: Iterable[str], valid: Iterable[str]) -> str:
    """`` (did you mean epochs?)`` for the unknown names with a close valid one (difflib); "" when none has."""
    import difflib

    valid = sorted(valid)
    pairs = [(name, difflib.get_close_matches(name, valid, n=1, cutoff=0.75)) for name in unknown]
    close = [f"{match[0]} for {name}" if len(pairs) > 1 else match[0] for name, match in pairs if match]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def config_from_mapping(cls: type, data: Mapping[str, Any], *, source: str = "config") -> Any:
    """Build the dataclass ``cls`` from a mapping, rejecting unknown keys with the list of valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)} for {cls.__name__}{did_you_mean(unknown, names)}; "
            f"valid keys are {', '.join(sorted(names))}."
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            # TOML has lists, never tuples; accept them where the default is a tuple.
            if isinstance(value, list) and isinstance(f.default, tuple):
                value = tuple(value)
            kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


#: the largest config or pipeline file read (a pipeline of every CAMELYON16 setting is a few KiB)
MAX_TOML_BYTES = 16 << 20


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML file with an error that names the file and the line on a syntax error. A UTF-8 byte-order mark
    (Windows editors write one) is skipped: TOML does not allow it, and the error pointed at a line that looks
    right in any editor (review BR)."""
    from wsi_milssl.paths import FileTooLarge, read_bounded

    path = Path(path)
    try:
        try:  # bounded: a device or pipe (/dev/zero) never ends (review ES)
            raw = read_bounded(path, MAX_TOML_BYTES)
        except FileTooLarge:
            raise ConfigError(f"{path}: more than {MAX_TOML_BYTES // (1 << 20)} MiB, far too large for a config file; "
                              "give a TOML file.") from None
        return tomllib.loads(raw.decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found; check the path.") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a config file; give the path of a TOML file "
                          "(e.g. pipelines/demo.toml).") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc}); check the path and "
                          "its permissions.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} cannot be decoded), so not a TOML file; "
                          "give a TOML file, or save this one as UTF-8.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc}); fix the syntax at that line.") from None


def write_resolved_config(config: Any, out_dir: str | os.PathLike, *, name: str = "config.json") -> Path:
    """Write the resolved config as JSON beside a stage's outputs (atomically) and return its path."""
    from wsi_milssl.atomic import atomic_write_json

    return atomic_write_json(Path(out_dir) / name, config_to_dict(config), sort_keys=True)
