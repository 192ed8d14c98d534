"""How the router picks a replica for a request.

- `round-robin`: the next replica that is up.
- `least-loaded`: the replica with the fewest requests in flight (the router's own count,
  plus the waiting requests the replica last reported in its /metrics).
- `prefix` (the default): the replica whose index (prefix_index.py) matches most of the
  prompt, within a load bound; with SGLang's cache-aware router as the known shape. When the
  loads are out of balance (the busiest has more than `balance_abs` requests beyond the
  least busy and more than `balance_rel` times it), the least loaded wins whatever the
  cache. Otherwise the best match wins if it covers at least `cache_threshold` of the
  prompt; below that, the least loaded (which then learns the prompt). Requests sharing a
  system prompt thus land where it is cached, until that replica is loaded enough to spill.
"""

from __future__ import annotations

import dataclasses
import itertools

from kvserve.router.prefix_index import CHUNK_CHARS, chunk_hashes

POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclasses.dataclass
class Choice:
    replica: object  # replicas.Replica
    matched_chars: int  # of the prompt's text the replica's index matched (0 outside the prefix policy)


class Policy:
    def __init__(self, name: str, balance_abs: int = 8, balance_rel: float = 1.5, cache_threshold: float = 0.5):
        self.name = name
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold
        self._turn = itertools.count()

    def choose(self, replicas: list, text: str, exclude: set[str] = frozenset()) -> Choice | None:
        """A replica that is up (not in `exclude`, the ones that failed this request), or None."""
        up = [r for r in replicas if r.up and r.url not in exclude]
        if not up:
            return None
        if self.name == "round-robin":
            return Choice(up[next(self._turn) % len(up)], 0)
        # ties: the replica that has seen the least (SGLang's smallest tree), so new prefixes spread
        least = min(up, key=lambda r: (r.load, len(r.prefixes), r.index))
        if self.name == "least-loaded":
            return Choice(least, 0)
        hashes = chunk_hashes(text)
        loads = [r.load for r in up]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            chosen, matched = least, least.prefixes.match(hashes)
        else:
            best = max(up, key=lambda r: (r.prefixes.match(hashes), -r.load, -r.index))
            matched = best.prefixes.match(hashes)
            if matched and matched * CHUNK_CHARS / len(text) >= self.cache_threshold:
                chosen = best
            else:
                chosen, matched = least, least.prefixes.match(hashes)
        chosen.prefixes.insert(hashes)
        return Choice(chosen, matched * CHUNK_CHARS)
