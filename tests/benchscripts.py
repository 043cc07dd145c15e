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


def one_error_line(done) -> str:
    """The stderr of a script run (a CompletedProcess) that refused its input: exit 2, one ``error:`` line, no
    traceback."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def kill_when(proc, ready, *, timeout_s: float) -> None:
    """SIGKILL the running script ``proc`` (a Popen with stderr piped) as soon as ``ready()`` holds, polling every
    20 ms for at most ``timeout_s``; fails when the script ended on its own first (the window was missed). A file
    ``ready`` reads that is not there (yet, or any more) is not ready."""
    import signal
    import time

    def holds() -> bool:
        try:
            return bool(ready())
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline and not holds():
        time.sleep(0.02)
    ended = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not ended, "the run ended before it was killed: " + proc.stderr.read().decode()[-2000:]
