"""Review ES, A3: a config, pipeline or labels file that never ends (a device such as /dev/zero, which reports size
0 as pipes do) was read whole: memory grew until a MemoryError traceback. The reads are bounded now."""

from __future__ import annotations

import pytest

from wsi_milssl.cohorts import read_labels
from wsi_milssl.config.base import load_toml
from wsi_milssl.errors import ConfigError, LabelsError


def test_a_config_file_that_never_ends_is_one_error():
    with pytest.raises(ConfigError, match=r"^/dev/zero: more than 16 MiB, far too large for a config file"):
        load_toml("/dev/zero")


def test_a_labels_file_that_never_ends_is_one_error():
    with pytest.raises(LabelsError, match=r"^/dev/zero: more than \d+ bytes, far too large for a slide-labels CSV"):
        read_labels("/dev/zero")
