"""The FROC protocol an evaluation follows, in words (metrics.json's ``froc_protocol``), and the CAMELYON16
challenge's constants: torch-, scikit-learn- and scikit-image-free, so that ``run`` checks an evaluation without
importing the evaluation stage."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from wsi_milssl.artifacts import EVALUATION_FILES

if TYPE_CHECKING:
    from wsi_milssl.config.evaluate import EvaluateConfig

__all__ = ["CAMELYON16_DOWNSAMPLE", "CAMELYON16_MPP", "MARGIN_UM", "ITC_MAJOR_AXIS_UM", "FP_RATES", "CAMELYON16_GROUPS",
           "froc_protocol", "froc_protocol_summary", "outdated_metrics"]

CAMELYON16_DOWNSAMPLE = 32
"""Level 5 of a CAMELYON16 pyramid: the evaluation mask's downsample from level 0."""
CAMELYON16_MPP = 0.243
"""The level-0 µm/px at which the CAMELYON16 script measures the margin and ITC limit of every slide (its
``L0_RESOLUTION``); the evaluation stage uses each slide's own unless ``EvaluateConfig.froc_mpp`` is set."""
MARGIN_UM = 75.0
"""Tumour regions are dilated by half of this distance (µm), about five tumour cells."""
ITC_MAJOR_AXIS_UM = 275.0
"""Regions of the (dilated) evaluation mask whose major axis is under this (µm) are ITCs."""
FP_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""False positives per slide at which the FROC score averages the sensitivity."""


#: the annotation groups of the challenge's files: _0 and _1 are tumour, _2 is carved out of them
CAMELYON16_GROUPS = {"tumor_groups": ("_0", "_1"), "non_tumor_groups": ("_2",)}


def _challenge_groups(config: EvaluateConfig) -> bool:
    """Whether the challenge's groups (:data:`CAMELYON16_GROUPS`) are read as the challenge reads them: other
    groups beside them (the defaults' ``Tumor``, ``Exclusion``) do not occur in its files."""
    return all({g.casefold() for g in groups} <= {g.strip().casefold() for g in getattr(config, field)}
               for field, groups in CAMELYON16_GROUPS.items())


def froc_protocol(config: EvaluateConfig) -> str:
    """"CAMELYON16" for the challenge script's settings (75 µm margin, 275 µm ITC limit, both measured at 0.243
    µm/px on every slide) with the challenge's annotation groups (:func:`_challenge_groups`), else the settings
    in words (e.g. "75 µm margin, 275 µm ITC limit, at each slide's own µm/px", followed by the groups where
    they are not the challenge's): the report and metrics.json call the FROC CAMELYON16's only when it is."""
    challenge_groups = _challenge_groups(config)
    if (config.margin_um, config.itc_major_axis_um, config.froc_mpp) == (MARGIN_UM, ITC_MAJOR_AXIS_UM, CAMELYON16_MPP) \
            and challenge_groups:
        return "CAMELYON16"
    at = "at each slide's own µm/px" if config.froc_mpp is None else f"at {config.froc_mpp:g} µm/px"
    words = f"{config.margin_um:g} µm margin, {config.itc_major_axis_um:g} µm ITC limit, {at}"
    if not challenge_groups:
        non_tumor = ("non-tumour groups " + ", ".join(config.non_tumor_groups) if config.non_tumor_groups
                     else "no non-tumour group")
        words += f", tumour groups {', '.join(config.tumor_groups)}, {non_tumor}"
    return words


def froc_protocol_summary(metrics: Mapping[str, Any]) -> str:
    """The FROC protocol of an evaluation's ``metrics.json`` in a few words, for one-line summaries:
    "CAMELYON16", or its settings without naming the annotation groups, e.g. "75 µm margin, 275 µm ITC limit,
    each slide's µm/px" (", other annotation groups" added where they are not the challenge's); "" for metrics
    that do not record it (an earlier version's)."""
    protocol = metrics.get("froc_protocol")
    if not protocol or protocol == "CAMELYON16":
        return protocol or ""
    margin, itc, mpp = metrics.get("margin_um"), metrics.get("itc_major_axis_um"), metrics.get("froc_mpp")
    if not isinstance(margin, (int, float)) or not isinstance(itc, (int, float)):
        return str(protocol)
    at = "each slide's µm/px" if mpp is None else f"at {mpp:g} µm/px"
    words = f"{margin:g} µm margin, {itc:g} µm ITC limit, {at}"
    return words + (", other annotation groups" if "tumour groups" in protocol else "")


def outdated_metrics(out_dir: str | os.PathLike, config: EvaluateConfig) -> str | None:
    """Why the evaluation in ``out_dir`` is an earlier version's, in one line, else None (also where it holds no
    metrics.json): its metrics.json records no ``froc_protocol`` (written before the FROC's settings were: its
    report called the FROC "CAMELYON16" at any µm/px), or another than ``config`` gives now (an earlier
    version's wording: "CAMELYON16" whatever the annotation groups). ``run`` evaluates again then, though the
    stage's stamp matches (these settings at their defaults leave it as it was)."""
    path = Path(out_dir) / EVALUATION_FILES["metrics"]
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return f"{path} cannot be read ({exc})"
    if not isinstance(recorded, dict) or "froc_protocol" not in recorded:
        return f"output of an earlier version: {path} records no froc_protocol"
    expected = froc_protocol(config)
    if recorded["froc_protocol"] != expected:
        return (f"output of an earlier version: {path} records froc_protocol {recorded['froc_protocol']!r}, "
                f"not {expected!r}")
    return None
