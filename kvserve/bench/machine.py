"""What a figure was measured on and with: CPU, threads, library versions, the commit.

Every JSON a benchmark writes carries this, so a number can be traced to its machine
and re-measured on the same one.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
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


def describe_machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # other work on the machine skews every figure: a load near the core count means a busy machine
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def command_line() -> str | None:
    """The command as typed, when kvserve was started from its console script."""
    if Path(sys.argv[0]).name in ("kvserve", "__main__.py", "cli.py"):
        return shlex.join(["kvserve", *sys.argv[1:]])
    return None


def envelope(benchmark: str, args: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The JSON a benchmark writes: what ran, where, when, and its figures."""
    return {
        "benchmark": benchmark,
        "command": command_line(),
        "args": {k: ("<redacted>" if "key" in k and v else v) for k, v in args.items() if k != "func" and not callable(v)},
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": describe_machine(),
        "results": results,
    }
