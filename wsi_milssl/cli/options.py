"""A config's values from ``--config`` TOML and the options given: a helper of the subcommand modules."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

__all__ = ["values_from_args", "output_folder", "config_table", "add_slide_mpp_option", "add_out_dir_argument",
           "out_dir_of"]


def values_from_args(args: argparse.Namespace, *, table: str, value_options: dict[str, str],
                     flag_options: dict[str, tuple[str, object]]) -> dict:
    """The ``--config`` TOML's values (its ``[table]``, or its top level), then each option given:
    ``value_options`` maps an option's dest to a config field, ``flag_options`` a flag's dest to (field,
    value set when the flag is given)."""
    values: dict = {}
    if getattr(args, "config", None) is not None:
        values.update(config_table(args.config, table))
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


def config_table(path: Path, table: str) -> dict:
    """The settings a ``--config`` (``--tile-config``) TOML file gives: its ``[table]``, or its top level when it has
    none. Keys at the top level beside that table are refused (review CX: they were dropped without a word)."""
    from wsi_milssl.config.base import load_toml
    from wsi_milssl.errors import ConfigError

    data = load_toml(path)
    pipeline = isinstance(data.get("pipeline"), dict) or isinstance(data.get("data"), dict)
    if pipeline and table not in data:  # (review EW: every table of it was listed as an unknown key)
        raise ConfigError(f"{path}: a pipeline file without a [{table}] table. Fix: give a TOML file of the stage's "
                          f"settings (a [{table}] table, or keys at its top level), or run the pipeline with "
                          f"`wsi-milssl run {shlex.quote(str(path))}`.")
    if pipeline and isinstance(data[table], dict) and isinstance(data[table].get("grid"), dict):
        raise ConfigError(f"{path}: [{table}.grid] is a pipeline's grid of settings, which `wsi-milssl run "
                          f"{shlex.quote(str(path))}` trains and chooses on validation slides; `{table}` trains one "
                          "setting. Fix: run the pipeline, or give one value of each grid setting as an option.")
    loose = sorted(k for k, v in data.items() if not isinstance(v, dict))
    if table in data and loose:
        raise ConfigError(f"{path}: {', '.join(loose)} at the top level beside a [{table}] table, which is the one "
                          f"read. Fix: move {'them' if len(loose) > 1 else 'it'} into [{table}].")
    return dict(data.get(table, data))


class _SlideMpp(argparse.Action):
    """``--slide-mpp``, and its older name ``--mpp``, said when used: in ``tile`` and ``features`` ``--mpp`` is the
    resolution read at, and ``info SLIDE --mpp 0.5`` rescaled the slide where a target was meant (review EW)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--mpp":
            from wsi_milssl.cli import stderr_line

            stderr_line(f"warning: {parser.prog}: --mpp {values:g} is taken as --slide-mpp, the older name: the "
                        "slides' own level-0 µm/px, in place of their metadata (in tile and features --mpp is the "
                        "resolution read at). Fix: write --slide-mpp.")
        setattr(namespace, self.dest, values)


def add_slide_mpp_option(parser: argparse.ArgumentParser, *, default, help: str) -> None:
    """The ``--slide-mpp MPP`` option (dest ``mpp``) of ``info`` and ``evaluate``, which also take ``--mpp``."""
    parser.add_argument("--slide-mpp", "--mpp", dest="mpp", type=float, default=default, metavar="MPP",
                        action=_SlideMpp, help=help)


def add_out_dir_argument(parser: argparse.ArgumentParser, *, help: str) -> None:
    """The output folder of ``synth`` and ``demo``: an OUT_DIR argument, or ``--out OUT_DIR`` as every other command
    names it (review EW: `synth --out DIR` was "unrecognized arguments"); read with :func:`out_dir_of`."""
    parser.add_argument("out_dir", nargs="?", type=output_folder, metavar="OUT_DIR", help=f"{help} (or --out OUT_DIR)")
    parser.add_argument("--out", dest="out_option", type=output_folder, default=None, metavar="OUT_DIR",
                        help="the same as OUT_DIR, as the other commands name their output folder")


def out_dir_of(args: argparse.Namespace) -> Path:
    """The output folder of :func:`add_out_dir_argument`; OptionError when none or two different ones are given."""
    from wsi_milssl.errors import OptionError

    given = [v for v in (args.out_dir, args.out_option) if v is not None]
    if not given:
        raise OptionError("OUT_DIR is required: the folder to write to (as OUT_DIR, or --out OUT_DIR).")
    if len(given) == 2 and given[0] != given[1]:
        raise OptionError(f"OUT_DIR {given[0]} and --out {given[1]} name two folders; give one.")
    return given[0]
