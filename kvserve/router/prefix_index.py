"""Which prompt prefixes each replica has seen: the router's approximate view of their caches.

The router never sees a replica's KV blocks, only the requests it sent there, so it keeps
what a replica has probably cached: for each replica, the chained hashes of the prompts'
leading chunks of CHUNK_CHARS characters (the way a prefix cache chains block hashes, in
characters instead of tokens, so the router needs no tokenizer). A new prompt's match on a
replica is the run of its leading chunks found there. Each replica's index is an LRU of at
most `max_chunks` entries, since the replica itself evicts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK_CHARS = 64


def chunk_hashes(text: str) -> list[bytes]:
    """The chained hash of each full chunk of `text`, in order."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start : start + CHUNK_CHARS].encode(), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixIndex:
    def __init__(self, max_chunks: int = 1 << 16):
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, hashes: list[bytes]) -> int:
        """Leading chunks of a prompt this replica has seen."""
        n = 0
        for h in hashes:
            if h not in self._chunks:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

    def clear(self) -> None:
        self._chunks.clear()
