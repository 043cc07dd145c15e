"""A config's values from ``--config`` TOML and the options given: a helper of the subcommand modules."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["values_from_args", "output_folder"]


def values_from_args(args: argparse.Namespace, *, table: str, value_options: dict[str, str],
                     flag_options: dict[str, tuple[str, object]]) -> dict:
    """The ``--config`` TOML's values (its ``[table]``, or its top level), then each option given:
    ``value_options`` maps an option's dest to a config field, ``flag_options`` a flag's dest to (field,
    value set when the flag is given)."""
    from wsi_milssl.config.base import load_toml

    values: dict = {}
    if getattr(args, "config", None) is not None:
        data = load_toml(args.config)
        values.update(data.get(table, data))
    for opt, name in value_options.items():
        value = getattr(args, opt, None)
        if value is not None:
            values[name] = value
    for opt, (name, value) in flag_options.items():
        if getattr(args, opt, False):
            values[name] = value
    return values


def output_folder(text: str) -> Path:
    """The argparse type of an output folder: an empty value (``--out "$OUT"`` with the variable unset) is refused
    instead of read as the current folder (review CX: every output went there)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give the output folder")
    return Path(text)
