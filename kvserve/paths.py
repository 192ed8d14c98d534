"""Where kvserve keeps files between runs; torch-free, so the planner can use it too.

One directory for every cache: converted weights (`converted/`), file hashes
(`hashes.json`), built kernels (`kernels/`) and the planner's `local_chip.json`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$KVSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`."""
    override = os.environ.get("KVSERVE_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "kvserve"
