"""Handoffs over torch.distributed point-to-point: gloo over TCP, so between hosts.

A decode instance listens (`--kv-transfer-listen HOST:PORT`): a TCPStore it hosts is where
prefill instances find it. A prefill instance sending to that address for the first time
registers itself in the store (a counter gives it a pair number). Both then build a
two-rank gloo group over the store's prefix for that pair: rank 0 the decode instance,
rank 1 the prefill instance. No process-wide `init_process_group` is involved, so any
number of pairs coexist with each other and with tensor parallelism's own group.

Per handoff, over the pair's group, in order:
1. a header, int64 [8]: layers, positions, KV heads, head size, dtype code, whether int8 scales
   follow, the transfer id's length; then the transfer id (UTF-8);
2. each layer's K and V, [2, P, N_kv, H] (and its scales), one message a layer, sent while
   the prefill computes the next layers (`open_send`: the connector hands each layer over as
   soon as it has run);
3. the metadata's length, then the metadata as UTF-8 JSON: the prompt, first token and
   logprobs, known only once the last layer has run and the token is sampled.

A pair's sending thread sends its queued handoffs one after another, so the layers of two
never interleave.

The decode instance's receiver thread for the pair reads the transfer id first. If a request
there expects it (`expect`: its blocks are allocated), each layer is written straight into
those blocks as it arrives; otherwise the handoff is staged whole and copied in when the
request takes it. `poll` then gives it by transfer id. A pair whose peer dies mid-handoff
fails that handoff at once (its request's failure policy applies), and the pair is dropped;
the sender raises KVTransferError (so the prefill answer reports it).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import queue
import threading
import time
import weakref

import torch
import torch.distributed as dist

from kvserve.disagg.handoff import KVHandoff
from kvserve.disagg.transport import KVTransferError, KVTransport, OutgoingHandoff

logger = logging.getLogger(__name__)

_DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
# a pair lives as long as its instances: its group must not time out between handoffs
_PAIR_TIMEOUT = datetime.timedelta(days=7)
CONNECT_TIMEOUT_S = 10.0  # reaching a decode instance's store, and building the pair
_FINISH_TIMEOUT_S = 60.0  # a handoff not delivered by then fails (a hung decode instance)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


class TorchDistributedTransport(KVTransport):
    name = "torch"

    def __init__(self, listen: str | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self._connect_timeout = datetime.timedelta(seconds=connect_timeout_s)
        # handoffs not taken yet: transfer id -> (when it came, the handoff, or why it broke off)
        self._untaken: dict[str, tuple[float, KVHandoff | str]] = {}
        self._sinks: dict = {}  # transfer id -> the BlockSink of the request expecting it
        self._failed_pairs = 0
        self._lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}  # sending side: address -> its pair
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._groups: list = []  # the receiving side's pair groups, dropped on close
        self.address: str | None = None  # where prefill instances reach this one (the receiving side)
        if listen is not None:
            host, port = _split(listen)
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=self._connect_timeout)
            self.address = f"{host}:{self._store.port}"
            self._threads.append(threading.Thread(target=self._accept, name="kv-transfer-accept", daemon=True))
            self._threads[-1].start()
        _OPEN.add(self)

    # ---- receiving (the decode side) ---------------------------------------------------

    def _accept(self) -> None:
        accepted = 0
        while not self._closed:
            store = self._store
            if store is None:  # closed
                return
            try:
                registered = store.add("senders", 0)
            except Exception:  # the store went with the process
                return
            while accepted < registered:
                accepted += 1
                t = threading.Thread(target=self._receive_pair, args=(accepted,), name=f"kv-transfer-pair{accepted}", daemon=True)
                self._threads.append(t)
                t.start()
            time.sleep(0.01)

    def _receive_pair(self, pair: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{pair}/", self._store), 0, 2, _PAIR_TIMEOUT)
            self._groups.append(group)
            received = 0
            while not self._closed:
                # idle in Python, not inside a gloo receive: the sender counts each handoff in
                # the store before its first message, and a process may exit with no wait in flight
                store = self._store
                if store is None:
                    return
                if store.add(f"pair{pair}/handoffs", 0) <= received:
                    time.sleep(0.005)
                    continue
                received += 1
                self._receive_one(group)
        except Exception as exc:  # the sender went away: this pair is over
            if not self._closed:
                logger.info("KV transfer pair %d ended: %s", pair, exc)
                self._failed_pairs += 1

    def _receive_one(self, group) -> None:
        header = torch.empty(8, dtype=torch.int64)
        group.recv([header], 1, 0).wait()
        layers, positions, kv_heads, head_dim, dtype_code, has_scales, id_len, _ = header.tolist()
        dtype = _DTYPES[dtype_code]
        raw_id = torch.empty(id_len, dtype=torch.uint8)
        group.recv([raw_id], 1, 0).wait()
        transfer_id = bytes(raw_id.numpy()).decode()
        with self._lock:
            sink = self._sinks.get(transfer_id)
        if sink is not None and not sink.accepts(layers, positions, kv_heads, head_dim, dtype, bool(has_scales)):
            sink = None  # staged instead: the connector's check names the mismatch
        kv = None if sink is not None else torch.empty((2, layers, positions, kv_heads, head_dim), dtype=dtype)
        scales = torch.empty((2, layers, positions, kv_heads), dtype=torch.float32) if has_scales and sink is None else None
        part = torch.empty((2, positions, kv_heads, head_dim), dtype=dtype)
        part_scales = torch.empty((2, positions, kv_heads), dtype=torch.float32) if has_scales else None
        try:
            for layer in range(layers):  # one message a layer, sent as the prefill computed them
                group.recv([part], 1, 0).wait()
                if part_scales is not None:
                    group.recv([part_scales], 1, 0).wait()
                if sink is None:
                    kv[:, layer] = part
                    if scales is not None:
                        scales[:, layer] = part_scales
                    continue
                with self._lock:  # into the request's blocks, unless it let them go meanwhile
                    if self._sinks.get(transfer_id) is sink:
                        sink.write_layer(layer, part, part_scales)
            meta_len = torch.empty(1, dtype=torch.int64)
            group.recv([meta_len], 1, 0).wait()
            meta_bytes = torch.empty(int(meta_len), dtype=torch.uint8)
            group.recv([meta_bytes], 1, 0).wait()
        except Exception as exc:  # the sender died mid-handoff: its request need not wait out the timeout
            with self._lock:
                self._untaken[transfer_id] = (time.monotonic(), f"{type(exc).__name__}: {exc}")
            raise
        meta = json.loads(bytes(meta_bytes.numpy()).decode())
        if meta.get("cancelled"):  # the prefill request was aborted mid-send
            with self._lock:
                self._untaken[transfer_id] = (time.monotonic(), "the prefill request was aborted")
            return
        logprobs = meta["first_logprobs"]
        handoff = KVHandoff(
            prompt_token_ids=meta["prompt_token_ids"], first_token=meta["first_token"], kv=kv, scales=scales,
            first_logprobs=None if logprobs is None else {int(k): float(v) for k, v in logprobs.items()},
            first_logprob=meta["first_logprob"],
            written_bytes=layers * (part.numel() * part.element_size() + (0 if part_scales is None else part_scales.numel() * 4)),
        )  # fmt: skip
        with self._lock:
            if kv is None and self._sinks.get(transfer_id) is not sink:
                return  # its request let the blocks go (aborted or failed) before the end: nobody takes it
            self._untaken[transfer_id] = (time.monotonic(), handoff)

    def poll(self, transfer_id: str) -> KVHandoff | None:
        with self._lock:
            _, taken = self._untaken.pop(transfer_id, (0.0, None))
        if isinstance(taken, str):
            raise KVTransferError(f"handoff {transfer_id} broke off: {taken}")
        return taken

    def discard(self, transfer_id: str) -> None:
        with self._lock:
            self._untaken.pop(transfer_id, None)

    def sweep(self, older_than_s: float) -> int:
        now = time.monotonic()
        with self._lock:
            stale = [tid for tid, (since, _) in self._untaken.items() if now - since > older_than_s]
            for tid in stale:
                del self._untaken[tid]
        return len(stale)

    def expect(self, transfer_id: str, sink) -> None:
        with self._lock:
            self._sinks[transfer_id] = sink

    def unexpect(self, transfer_id: str) -> None:
        with self._lock:  # a layer being written finishes first; none follows
            self._sinks.pop(transfer_id, None)

    # ---- sending (the prefill side) -----------------------------------------------------

    def _pair(self, address: str) -> "_Pair":
        with self._lock:
            pair = self._pairs.get(address)
            if pair is not None and pair.broken is None:
                return pair
        host, port = _split(address)
        store = dist.TCPStore(host, port, is_master=False, timeout=self._connect_timeout)
        number = store.add("senders", 1)
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{number}/", store), 1, 2, _PAIR_TIMEOUT)
        pair = _Pair(group, store, address, number)
        with self._lock:
            self._pairs[address] = pair
        return pair

    def open_send(self, transfer_id: str, address: str | None, kv: torch.Tensor, scales: torch.Tensor | None) -> "_StreamedSend":
        if address is None:
            raise KVTransferError(f"handoff {transfer_id}: no decode instance address (kv_transfer_params.remote_address)")
        try:
            pair = self._pair(address)
        except Exception as exc:
            raise KVTransferError(f"handoff {transfer_id} to {address}: {type(exc).__name__}: {exc}") from exc
        return _StreamedSend(pair, transfer_id, kv, scales)

    def send(self, transfer_id: str, handoff: KVHandoff, address: str | None = None) -> None:
        """The whole handoff at once (every layer ready)."""
        out = self.open_send(transfer_id, address, handoff.kv, handoff.scales)
        for layer in range(handoff.kv.shape[1]):
            out.layer_ready(layer)
        out.finish(handoff)

    def close(self) -> None:
        """Stop the threads (idle ones leave within a poll), then let go of the groups and
        stores, pairs before stores: torn down at interpreter exit with their threads still
        running, gloo's and the store's C++ threads abort the process."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.stop()
        for t in self._threads + [p.thread for p in pairs]:
            t.join(timeout=2)
        self._groups.clear()
        for pair in pairs:
            pair.group = pair.store = None
        self._store = None
        _OPEN.discard(self)


_OPEN: "weakref.WeakSet[TorchDistributedTransport]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for transport in list(_OPEN):
        transport.close()


class _Pair:
    """The sending side of one pair: its group, and a thread that sends the queued handoffs
    one after another, each message in order (two handoffs' layers never interleave)."""

    def __init__(self, group, store, address: str, number: int):
        self.group, self.store, self.address, self.number = group, store, address, number
        self.jobs: queue.Queue[_StreamedSend | None] = queue.Queue()
        self.broken: Exception | None = None
        self.thread = threading.Thread(target=self._run, name=f"kv-transfer-send-{address}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.broken is not None:  # an earlier handoff broke the pair: this one cannot go
                job.fail(self.broken)
                continue
            try:
                self.store.add(f"pair{self.number}/handoffs", 1)  # the receiver starts receiving now
                while (message := job.messages.get()) is not None:
                    self.group.send([message], 0, 0).wait()
                job.done.set()
            except Exception as exc:
                self.broken = exc
                job.fail(exc)


class _StreamedSend(OutgoingHandoff):
    """A handoff whose layers go out as they are computed: header now, each layer on
    `layer_ready`, the metadata (first token) on `finish`, which waits for delivery."""

    def __init__(self, pair: _Pair, transfer_id: str, kv: torch.Tensor, scales: torch.Tensor | None):
        self.pair, self.transfer_id, self.kv, self.scales = pair, transfer_id, kv, scales
        self.messages: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.done = threading.Event()
        self.error: Exception | None = None
        self.queued: set[int] = set()
        raw_id = transfer_id.encode()
        self.messages.put(torch.tensor([kv.shape[1], kv.shape[2], kv.shape[3], kv.shape[4], _DTYPES.index(kv.dtype),
                                        int(scales is not None), len(raw_id), 0], dtype=torch.int64))  # fmt: skip
        self.messages.put(torch.frombuffer(bytearray(raw_id), dtype=torch.uint8))
        pair.jobs.put(self)

    def fail(self, exc: Exception) -> None:
        self.error = exc
        self.done.set()

    def layer_ready(self, layer: int) -> None:
        if layer in self.queued:
            return
        self.queued.add(layer)
        self.messages.put(self.kv[:, layer].contiguous())  # a copy: the buffer may be reused
        if self.scales is not None:
            self.messages.put(self.scales[:, layer].contiguous())

    def _end(self, meta: dict) -> None:
        data = json.dumps({"transfer_id": self.transfer_id, **meta}).encode()
        self.messages.put(torch.tensor([len(data)], dtype=torch.int64))
        self.messages.put(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.messages.put(None)

    def finish(self, handoff: KVHandoff) -> None:
        self._end({"prompt_token_ids": handoff.prompt_token_ids, "first_token": handoff.first_token,
                   "first_logprobs": None if handoff.first_logprobs is None else
                   {str(k): v for k, v in handoff.first_logprobs.items()},
                   "first_logprob": handoff.first_logprob})  # fmt: skip
        if not self.done.wait(timeout=_FINISH_TIMEOUT_S):
            raise KVTransferError(f"handoff {self.transfer_id} to {self.pair.address}: not delivered within {_FINISH_TIMEOUT_S:g} s")
        if self.error is not None:
            raise KVTransferError(f"handoff {self.transfer_id} to {self.pair.address}: {type(self.error).__name__}: {self.error}")

    def cancel(self) -> None:
        """The receiver expects every layer: the missing ones go as they are (never read), then a cancelled mark."""
        for layer in range(self.kv.shape[1]):
            self.layer_ready(layer)
        self._end({"cancelled": True})
