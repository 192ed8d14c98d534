"""How a handoff travels from the prefill instance to the decode instance.

- `SharedMemoryTransport`: instances on one host. The sender writes the handoff into a file
  under /dev/shm (written under a temporary name, then renamed, so a reader never sees half
  of one); the receiver polls for it, reads it and removes it. The write is the
  acknowledgement: once `send` returns, the prefill side may free its blocks.
- `TorchDistributedTransport` (torch_transport.py): between hosts, layer by layer.

A decode request's blocks are allocated before its handoff arrives: `expect` gives the
transport a `BlockSink` for them, so one that receives layer by layer writes straight into
the blocks; `unexpect` stops that before the blocks can go to another request.

Transfer ids name files, so they are checked: letters, digits, '-' and '_'.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from kvserve.disagg.handoff import KVHandoff
from kvserve.errors import InvalidRequestError

_TRANSFER_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class KVTransferError(RuntimeError):
    """A handoff that did not arrive: the transport failed, or it timed out."""


def check_transfer_id(transfer_id: str) -> str:
    if not isinstance(transfer_id, str) or not _TRANSFER_ID.fullmatch(transfer_id):
        raise InvalidRequestError(f"transfer_id must be 1-128 letters, digits, '-' or '_', got {transfer_id!r}", "kv_transfer_params")
    return transfer_id


class OutgoingHandoff:
    """One handoff being sent, layer by layer as the prefill computes them: `layer_ready(l)`
    once layer l's K/V are in the buffer, `finish(handoff)` once the first token is known
    (it returns when the handoff is delivered, or raises KVTransferError). This default
    gathers the layers and sends the whole handoff at `finish`."""

    def __init__(self, transport: "KVTransport", transfer_id: str, address: str | None):
        self.transport, self.transfer_id, self.address = transport, transfer_id, address

    def layer_ready(self, layer: int) -> None:
        pass

    def finish(self, handoff: KVHandoff) -> None:
        self.transport.send(self.transfer_id, handoff, self.address)

    def cancel(self) -> None:
        """The request was aborted before its first token: nothing more goes out."""


class KVTransport:
    name = "none"

    address: str | None = None  # where senders reach this instance, for transports that need one

    def open_send(self, transfer_id: str, address: str | None, kv, scales) -> OutgoingHandoff:
        """Start sending a handoff whose K/V (and int8 scales) fill `kv` / `scales` layer by layer."""
        return OutgoingHandoff(self, transfer_id, address)

    def send(self, transfer_id: str, handoff: KVHandoff, address: str | None = None) -> None:
        """Deliver the handoff (to the decode instance at `address`, where the transport needs one)."""
        raise NotImplementedError

    def poll(self, transfer_id: str) -> KVHandoff | None:
        """The handoff if it has arrived (taken: a second poll finds nothing), else None;
        raises KVTransferError if it cannot arrive."""
        raise NotImplementedError

    def discard(self, transfer_id: str) -> None:
        """Forget a handoff nobody will take (its request was aborted)."""

    def close(self) -> None:
        """Let go of threads and connections (nothing to do for most transports)."""

    def sweep(self, older_than_s: float) -> int:
        """Forget handoffs that arrived more than `older_than_s` ago and were never taken (their
        decode request never came, or timed out first); how many. Called as requests poll."""
        return 0

    def expect(self, transfer_id: str, sink: "BlockSink") -> None:
        """The receiving request's blocks are allocated: a transport that receives layer by
        layer may write the handoff straight into them through `sink`. This default stages
        the whole handoff and the connector copies it in once it has arrived."""

    def unexpect(self, transfer_id: str) -> None:
        """The request no longer takes its handoff into those blocks (it was loaded, failed or
        aborted): once this returns, nothing more is written into them."""


class BlockSink:
    """Where one expected handoff's K/V go: the receiving request's blocks, for the positions
    its local prefix-cache hit does not already hold. The transport checks `accepts` on the
    handoff's header, then calls `write_layer` for each layer as it arrives."""

    def __init__(self, kv_pool, kv_scales, blocks, offsets, start: int, num_positions: int):
        self.kv_pool, self.kv_scales = kv_pool, kv_scales  # [2, L, blocks, block_size, N_kv, H], [2, L, blocks, block_size, N_kv]
        self.blocks, self.offsets = blocks, offsets  # the slots of positions start..P-1
        self.start, self.num_positions = start, num_positions

    def accepts(self, layers: int, positions: int, kv_heads: int, head_dim: int, dtype, has_scales: bool) -> bool:
        pool = self.kv_pool
        return (layers, positions, kv_heads, head_dim, dtype) == (pool.shape[1], self.num_positions, pool.shape[4], pool.shape[5],
                                                                   pool.dtype) and has_scales == (self.kv_scales is not None)  # fmt: skip

    def write_layer(self, layer: int, kv, scales=None) -> None:
        """K and V of every prompt position for `layer` ([2, P, N_kv, H], scales [2, P, N_kv])."""
        for i in (0, 1):
            self.kv_pool[i, layer, self.blocks, self.offsets] = kv[i, self.start :]
            if scales is not None:
                self.kv_scales[i, layer, self.blocks, self.offsets] = scales[i, self.start :]

    def load(self, handoff: KVHandoff) -> None:
        """A staged handoff, every layer at once."""
        for layer in range(handoff.kv.shape[1]):
            self.write_layer(layer, handoff.kv[:, layer], None if handoff.scales is None else handoff.scales[:, layer])


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self, directory: str | Path | None = None):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.directory = Path(directory or os.path.join(base, "kvserve-kv"))
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, transfer_id: str) -> Path:
        return self.directory / f"{check_transfer_id(transfer_id)}.kv"

    def send(self, transfer_id: str, handoff: KVHandoff, address: str | None = None) -> None:
        path = self._path(transfer_id)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(handoff.to_bytes())
        os.replace(tmp, path)

    def poll(self, transfer_id: str) -> KVHandoff | None:
        path = self._path(transfer_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        try:
            return KVHandoff.from_bytes(data)
        except Exception as exc:  # a corrupt file: the handoff failed
            raise KVTransferError(f"handoff {transfer_id} is unreadable: {exc}") from exc

    def discard(self, transfer_id: str) -> None:
        self._path(transfer_id).unlink(missing_ok=True)

    def sweep(self, older_than_s: float) -> int:
        """Handoff files (and a dead writer's temporaries) older than that: on a host whose
        prefill instances outlive the decode requests, /dev/shm would otherwise keep them."""
        now, removed = time.time(), 0
        for path in self.directory.glob("*.*"):
            try:
                if now - path.stat().st_mtime > older_than_s:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # taken meanwhile
                pass
        return removed
