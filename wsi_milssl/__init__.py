"""wsi-milssl: whole-slide images to an instance-level tumour classifier with MIL-SSL.

Stages live in one subpackage each: ``slide`` (reading at a physical resolution),
``synth`` (generated slides), ``annotations``, ``store``, ``tiling``, ``mil``,
``inference`` and ``evaluation``. The command line is in ``cli``.
"""

from importlib.metadata import PackageNotFoundError, version

from wsi_milssl import parent_watch as _parent_watch  # noqa: F401 - records the launcher's pid at start (torchrun)

try:
    __version__ = version("wsi-milssl")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
