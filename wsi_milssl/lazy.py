"""Package attributes imported on first use (PEP 562), so that importing a package or one of its
torch-free submodules does not import torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose public names live in other modules.

    ``exports``: public name -> the module that defines it. A name is imported when first read and
    kept in the package's namespace, so later reads are plain attribute reads; another name is the package's
    submodule of that name, imported (``package.froc``), else AttributeError."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            if name.isidentifier() and not name.startswith("_"):  # a submodule, as in an eager package (review CO)
                try:
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError as exc:
                    if exc.name != f"{package}.{name}":
                        raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
