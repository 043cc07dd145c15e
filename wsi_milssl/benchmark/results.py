"""Reading a benchmark's saved results (the JSON the scripts in benchmarks/ write beside their tables)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wsi_milssl.errors import ConfigError

__all__ = ["read_result_json"]


def read_result_json(path: str | Path, *, fix: str) -> Any:
    """The JSON in ``path``; ConfigError naming the file, and ``fix`` where the file is missing or unreadable, for
    one that is missing, unreadable, or not complete JSON (cut off or edited)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; {fix}.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc}); {fix}.") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not complete JSON ({exc.msg}: line {exc.lineno} column {exc.colno}): a cut-off "
                          "or edited file; re-run the benchmark or restore the file.") from None
