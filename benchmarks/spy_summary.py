"""Summarise py-spy's collapsed stacks (``py-spy record --format raw --threads --subprocesses --idle``).

    python benchmarks/spy_summary.py logs/heatmap.spy                   # every process and thread
    python benchmarks/spy_summary.py logs/train224.spy --within _fit     # only samples under a function
    python benchmarks/spy_summary.py logs/train224.spy --thread MainThread --top 30

For each process (its command shortened) and thread: the samples taken (at ``--rate`` Hz this is time,
idle included), then the functions its time is spent in: ``self`` (the innermost frame of a sample, so
waits show as the wait call) and ``incl`` (every sample whose stack holds the function). ``--within F``
keeps only samples whose stack holds a frame whose name contains ``F`` (e.g. one phase of a run).
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter, defaultdict
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<where>[^()]*)\)$")


def _open(path: Path):
    return gzip.open(path, "rt", errors="replace") if path.suffix == ".gz" else open(path, errors="replace")


def _frame_name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    where = m.group("where").rsplit(":", 1)[0]
    return f"{m.group('func')} ({Path(where).name})"


def read(path: Path, within: str | None = None):
    """{(process, thread): [(frames, count)]} of the file's lines."""
    found: dict[tuple[str, str], list[tuple[list[str], int]]] = defaultdict(list)
    with _open(path) as fh:
        for line in fh:
            line = line.rstrip("\n")
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            parts = stack.split(";")
            process = parts[0] if parts[0].startswith("process ") else "?"
            rest = parts[1:] if process != "?" else parts
            thread = rest[0] if rest and rest[0].startswith("thread ") else "?"
            frames = rest[1:] if thread != "?" else rest
            if within and not any(within in f for f in frames):
                continue
            found[(process, thread)].append((frames, int(count)))
    return found


def _short_process(process: str) -> str:
    m = re.match(r'process (\d+):"(.*)"', process)
    if not m:
        return process
    cmd = m.group(2)
    if "forkserver" in cmd:
        cmd = "forkserver/reader"
    elif "multiprocessing" in cmd or "resource_tracker" in cmd:
        cmd = cmd.split(" import ")[-1][:60]
    return f"{m.group(1)} {cmd[:110]}"


def summarise(found, *, top: int, thread_filter: str | None, min_samples: int) -> str:
    lines = []
    by_process: dict[str, list[tuple[str, list]]] = defaultdict(list)
    for (process, thread), samples in found.items():
        by_process[process].append((thread, samples))
    order = sorted(by_process, key=lambda p: -sum(c for _, s in by_process[p] for _, c in s))
    for process in order:
        threads = by_process[process]
        total = sum(c for _, s in threads for _, c in s)
        if total < min_samples:
            continue
        lines.append(f"\n## {_short_process(process)}: {total} samples")
        for thread, samples in sorted(threads, key=lambda t: -sum(c for _, c in t[1])):
            n = sum(c for _, c in samples)
            if n < min_samples or (thread_filter and thread_filter not in thread):
                continue
            own, incl = Counter(), Counter()
            for frames, c in samples:
                names = [_frame_name(f) for f in frames]
                if names:
                    own[names[-1]] += c
                for name in set(names):
                    incl[name] += c
            lines.append(f"### {thread}: {n} samples")
            lines.append("self: " + "; ".join(f"{k} {v / n:.0%}" for k, v in own.most_common(top)))
            lines.append("incl: " + "; ".join(f"{k} {v / n:.0%}" for k, v in incl.most_common(top)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spy", type=Path, help="py-spy raw output (.spy, or .gz)")
    p.add_argument("--within", default=None, help="only samples with a frame containing this text")
    p.add_argument("--thread", default=None, help="only threads whose name contains this text")
    p.add_argument("--top", type=int, default=12, help="functions per list")
    p.add_argument("--min-samples", type=int, default=20, help="leave out smaller processes and threads")
    args = p.parse_args(argv)
    print(summarise(read(args.spy, args.within), top=args.top, thread_filter=args.thread,
                    min_samples=args.min_samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
