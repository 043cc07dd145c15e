"""Load a script of ``benchmarks/`` (not a package) as a module, for the tests of its helpers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
