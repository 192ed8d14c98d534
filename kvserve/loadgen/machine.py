"""What a figure was measured on and with: CPU, threads, library versions, the commit.

Every JSON a benchmark writes carries this, and a simulator calibration its CPU, so a
number can be traced to its machine and re-measured on the same one.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """HEAD of the checkout kvserve runs from, with `-dirty` when it has local changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_busy_fraction(seconds: float = 0.5) -> float | None:
    """Share of all CPUs' time spent busy over a short window (Linux /proc/stat), before the run."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (idle1 - idle0) / max(total1 - total0, 1), 3)


def describe_machine() -> dict[str, Any]:
    import torch

    from kvserve.kernels.isa import runnable_levels

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        # the kernel ISA levels this CPU runs (kvserve/kernels/isa.py), lowest first
        "cpu_isa_levels": list(runnable_levels()),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _own_cpu_s() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # peers that ran in their own process
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class ContentionMeter:
    """CPU time other processes took while the benchmark ran: all CPUs' busy time minus
    this process's and its finished children's. Near 0 means the figures are the
    engine's alone; for `bench serve` the server is one of the others."""

    def __init__(self) -> None:
        try:
            self._busy, self._total = _cpu_jiffies()
        except (OSError, ValueError, IndexError):
            self._busy = None
        self._own_s = _own_cpu_s()
        self._wall_s = time.perf_counter()

    def read(self) -> dict[str, float | None]:
        wall_s = time.perf_counter() - self._wall_s
        own_s = _own_cpu_s() - self._own_s
        cpus = os.cpu_count() or 1
        result: dict[str, float | None] = {"wall_s": round(wall_s, 2), "own_cpu_fraction": round(own_s / (wall_s * cpus), 3)}
        if self._busy is None:
            result["others_cpu_fraction"] = None
            return result
        busy, total = _cpu_jiffies()
        busy_share = (busy - self._busy) / max(total - self._total, 1)
        result["others_cpu_fraction"] = round(max(0.0, busy_share - own_s / (wall_s * cpus)), 3)
        return result


def contention_before_run() -> dict[str, float | None]:
    """How busy the machine was just before the benchmark began (its own load excluded):
    other work on shared cores skews every figure, so each JSON records it."""
    return {
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "cpu_busy_fraction": cpu_busy_fraction(0.5),
    }


def command_line() -> str | None:
    """The command as typed, when kvserve was started from its console script."""
    if Path(sys.argv[0]).name in ("kvserve", "__main__.py", "cli.py"):
        return shlex.join(["kvserve", *sys.argv[1:]])
    return None


def envelope(benchmark: str, args: dict[str, Any], results: dict[str, Any], before: dict[str, Any] | None = None,
             during: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON a benchmark writes: what ran, where, when, how busy the machine was, and its figures."""
    machine = describe_machine()
    machine["before_run"] = before
    machine["during_run"] = during
    return {
        "benchmark": benchmark,
        "command": command_line(),
        "args": {k: ("<redacted>" if "key" in k and v else v) for k, v in args.items() if k != "func" and not callable(v)},
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine,
        "results": results,
    }
