"""Build kernel levels ahead of their first use: `python -m kvserve.kernels.prebuild [LEVEL ...]`
(default: the chosen level).

A build is what `cpu_ops(level)` would compile on first use, into the same cache folder, so a
later `cpu_ops` loads it at once; a process that needs a level while this one builds it waits
for the build (torch's lock in the build folder) instead of compiling it twice. The test suite
runs this at low priority beside its first tests, so the levels it tests compile on cores the
tests leave idle. SIGTERM stops it cleanly, compilers included: the build's lock is released,
not left behind for the next process to wait on.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def _stop(signum, frame):
    """SIGTERM: stop the build's ninja first (it stops its compilers, each in a process group of
    its own, and removes their half-written objects), then leave through torch's `finally`,
    which releases the build's lock."""
    children = _children(os.getpid())
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise SystemExit(1)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # not Linux: the signal reaches only this process
        return []


def _running(pid: int) -> bool:
    """Alive and not yet a zombie (a zombie is done; its parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop)
    from kvserve.errors import ConfigError
    from kvserve.kernels import cpu_ops, unavailable_reason
    from kvserve.kernels.isa import check_level

    levels = argv or [None]
    failed = 0
    for level in levels:
        try:
            if level is not None:
                check_level(level, "level")
        except ConfigError as exc:
            print(f"kvserve: error: {exc}", file=sys.stderr)
            return 2
        if cpu_ops(level) is None:
            print(f"kvserve: the {level or 'chosen'} kernels are not available: {unavailable_reason(level)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
