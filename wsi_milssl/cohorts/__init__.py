"""Cohorts: slide names and slide labels, read one way for every stage.

- ``slide_stem(name)`` / ``stem_key(name)``: the name a slide's outputs are keyed by, and the
  case-insensitive key stems are matched with; ``SLIDE_SUFFIXES``: whole-slide file suffixes.
- ``read_labels(labels.csv)`` -> ``SlideLabels`` (``{stem: 0/1}``, case-insensitive lookups);
  ``labels_for(labels, names)``: the labels of given slides, or one error listing every name
  without a label; ``read_label_groups(labels.csv)``: each slide's patient, from a header column of
  ``GROUP_COLUMNS`` (``patient``, ``patient_id``, ``case_id``, ``case_submitter_id``); ``label_groups_for(labels.csv,
  names)``: those of given slides.
- ``stratified_split(labels, fraction=, seed=, groups=)``: the seeded, stratified split of slides (or of
  whole patients) that ``prepare``'s test set and ``run``'s validation slides are held out by.
- ``prepare_camelyon16(ROOT, OUT)`` / ``prepare_folder(SLIDES, LABELS, OUT)`` (``wsi-milssl prepare``):
  a downloaded cohort -> slide lists, label files, annotations and a ready pipeline TOML.
"""

from wsi_milssl.cohorts.labels import (GROUP_COLUMNS, LABEL_WORDS, NAME_COLUMNS, SlideLabels, labels_for,
                                      read_label_groups, read_labels)
from wsi_milssl.cohorts.names import NAME_SUFFIXES, SLIDE_SUFFIXES, STORE_SUFFIXES, slide_stem, stem_key
from wsi_milssl.cohorts.prepare import PreparedCohort, find_slide_files, prepare_camelyon16, prepare_folder
from wsi_milssl.cohorts.split import label_groups_for, stratified_split

__all__ = [
    "GROUP_COLUMNS",
    "LABEL_WORDS",
    "NAME_COLUMNS",
    "NAME_SUFFIXES",
    "PreparedCohort",
    "SLIDE_SUFFIXES",
    "STORE_SUFFIXES",
    "SlideLabels",
    "find_slide_files",
    "label_groups_for",
    "labels_for",
    "prepare_camelyon16",
    "prepare_folder",
    "read_label_groups",
    "read_labels",
    "slide_stem",
    "stem_key",
    "stratified_split",
]
