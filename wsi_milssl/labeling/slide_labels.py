"""Slide labels for the label stage: the one reader, :func:`wsi_milssl.cohorts.read_labels`.

Kept as this stage's name (``read_slide_labels``) for existing callers; the
accepted layouts, label words and errors are documented in :mod:`wsi_milssl.cohorts.labels`.
"""

from __future__ import annotations

from wsi_milssl.cohorts import read_labels as read_slide_labels

__all__ = ["read_slide_labels"]
