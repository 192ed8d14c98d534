"""KV cache events, in vLLM's names, for routers that follow what each server has cached.

vLLM publishes `BlockStored` (blocks that became findable by their hash: the hashes, the
parent's hash, their token ids, the block size), `BlockRemoved` (cached blocks evicted) and
`AllBlocksCleared` (the prefix cache reset). kvserve records the same events, with the same
fields, in a bounded log (`--enable-kv-cache-events`), which the server serves at
`GET /v1/kv_events?since=SEQ`. vLLM sends them over ZMQ; a router polling HTTP needs no
other dependency. Hashes are hex strings of kvserve's block hashes (request.py). The engine
thread writes and the server thread reads, so the log takes a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

DEFAULT_MAX_EVENTS = 65536


class KVEventLog:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS):
        self._events: deque[dict] = deque(maxlen=max_events)
        self._next_seq = 0
        self._lock = threading.Lock()

    def _add(self, event: dict) -> None:
        with self._lock:
            event["seq"] = self._next_seq
            event["timestamp"] = time.time()
            self._next_seq += 1
            self._events.append(event)

    def stored(self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None:
        self._add({"type": "BlockStored", "block_hashes": [h.hex() for h in block_hashes],
                   "parent_block_hash": parent.hex() if parent is not None else None,
                   "token_ids": token_ids, "block_size": block_size})  # fmt: skip

    def removed(self, block_hashes: list[bytes]) -> None:
        self._add({"type": "BlockRemoved", "block_hashes": [h.hex() for h in block_hashes]})

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def since(self, seq: int) -> dict:
        """Events numbered `seq` on, the number to ask from next time, and whether some
        between were dropped (the log keeps the latest `max_events`): then resync from scratch."""
        with self._lock:
            first = self._events[0]["seq"] if self._events else self._next_seq
            events = [dict(e) for e in self._events if e["seq"] >= seq]
            return {"events": events, "next_seq": self._next_seq, "dropped": seq < first}
