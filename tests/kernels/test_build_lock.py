"""The kernel build's lock: a live build is waited for, a dead one's lock is cleared."""

from __future__ import annotations

import os
import threading
import time

from kvserve.kernels import _STALE_LOCK_S, _wait_for_other_builds


def test_a_killed_builds_lock_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - _STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    _wait_for_other_builds(lock)
    assert not lock.exists()


def test_a_live_build_is_waited_for(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.6, lock.unlink).start()  # the other build finishes
    start = time.monotonic()
    _wait_for_other_builds(lock)
    assert time.monotonic() - start >= 0.5 and not lock.exists()
