"""Handoffs over torch.distributed point-to-point: gloo over TCP, so between hosts.

A decode instance listens (`--kv-transfer-listen HOST:PORT`): a TCPStore it hosts is where
prefill instances find it. A prefill instance sending to that address for the first time
registers itself in the store (a counter gives it a pair number). Both then build a
two-rank gloo group over the store's prefix for that pair: rank 0 the decode instance,
rank 1 the prefill instance. No process-wide `init_process_group` is involved, so any
number of pairs coexist with each other and with tensor parallelism's own group.

Per handoff, over the pair's group, in order:
1. a header, int64 [8]: metadata length, layers, positions, KV heads, head size, dtype code, whether scales follow;
2. the metadata as UTF-8 JSON bytes: the transfer id, prompt, first token and logprobs;
3. each layer's K and V, [2, P, N_kv, H], one message a layer (and its int8 scales).

The decode instance's receiver thread for the pair stores each handoff by transfer id, and
`poll` takes it from there. A pair whose peer dies fails its next send or receive, and is
dropped: the sender raises KVTransferError (so the prefill answer reports it), and the
waiting decode request times out into its failure policy.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch
import torch.distributed as dist

from kvserve.disagg.handoff import KVHandoff
from kvserve.disagg.transport import KVTransferError, KVTransport

logger = logging.getLogger(__name__)

_DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
# a pair lives as long as its instances: its group must not time out between handoffs
_PAIR_TIMEOUT = datetime.timedelta(days=7)
CONNECT_TIMEOUT_S = 10.0  # reaching a decode instance's store, and building the pair


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


class TorchDistributedTransport(KVTransport):
    name = "torch"

    def __init__(self, listen: str | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self._connect_timeout = datetime.timedelta(seconds=connect_timeout_s)
        self._arrived: dict[str, KVHandoff] = {}
        self._failed_pairs = 0
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[object, threading.Lock]] = {}  # sending side: address -> (group, its lock)
        self._stores: dict[str, dist.TCPStore] = {}
        self._closed = False
        self.address: str | None = None  # where prefill instances reach this one (the receiving side)
        if listen is not None:
            host, port = _split(listen)
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=self._connect_timeout)
            self.address = f"{host}:{self._store.port}"
            threading.Thread(target=self._accept, name="kv-transfer-accept", daemon=True).start()

    # ---- receiving (the decode side) ---------------------------------------------------

    def _accept(self) -> None:
        accepted = 0
        while not self._closed:
            try:
                registered = self._store.add("senders", 0)
            except Exception:  # the store went with the process
                return
            while accepted < registered:
                accepted += 1
                threading.Thread(target=self._receive_pair, args=(accepted,), name=f"kv-transfer-pair{accepted}", daemon=True).start()
            time.sleep(0.01)

    def _receive_pair(self, pair: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{pair}/", self._store), 0, 2, _PAIR_TIMEOUT)
            while not self._closed:
                handoff, transfer_id = self._receive_one(group)
                with self._lock:
                    self._arrived[transfer_id] = handoff
        except Exception as exc:  # the sender went away: this pair is over
            if not self._closed:
                logger.info("KV transfer pair %d ended: %s", pair, exc)
                self._failed_pairs += 1

    @staticmethod
    def _receive_one(group) -> tuple[KVHandoff, str]:
        header = torch.empty(8, dtype=torch.int64)
        group.recv([header], 1, 0).wait()
        meta_len, layers, positions, kv_heads, head_dim, dtype_code, has_scales, _ = header.tolist()
        meta_bytes = torch.empty(meta_len, dtype=torch.uint8)
        group.recv([meta_bytes], 1, 0).wait()
        meta = json.loads(bytes(meta_bytes.numpy()).decode())
        kv = torch.empty((2, layers, positions, kv_heads, head_dim), dtype=_DTYPES[dtype_code])
        scales = torch.empty((2, layers, positions, kv_heads), dtype=torch.float32) if has_scales else None
        for layer in range(layers):  # one message a layer, as the sender saved them
            part = torch.empty((2, positions, kv_heads, head_dim), dtype=kv.dtype)
            group.recv([part], 1, 0).wait()
            kv[:, layer] = part
            if scales is not None:
                s = torch.empty((2, positions, kv_heads), dtype=torch.float32)
                group.recv([s], 1, 0).wait()
                scales[:, layer] = s
        logprobs = meta["first_logprobs"]
        return KVHandoff(
            prompt_token_ids=meta["prompt_token_ids"], first_token=meta["first_token"], kv=kv, scales=scales,
            first_logprobs=None if logprobs is None else {int(k): float(v) for k, v in logprobs.items()},
            first_logprob=meta["first_logprob"],
        ), meta["transfer_id"]  # fmt: skip

    def poll(self, transfer_id: str) -> KVHandoff | None:
        with self._lock:
            return self._arrived.pop(transfer_id, None)

    def discard(self, transfer_id: str) -> None:
        with self._lock:
            self._arrived.pop(transfer_id, None)

    # ---- sending (the prefill side) -----------------------------------------------------

    def _pair(self, address: str):
        with self._lock:
            if address in self._pairs:
                return self._pairs[address]
        host, port = _split(address)
        store = dist.TCPStore(host, port, is_master=False, timeout=self._connect_timeout)
        pair = store.add("senders", 1)
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{pair}/", store), 1, 2, _PAIR_TIMEOUT)
        entry = (group, threading.Lock())
        with self._lock:
            self._stores[address] = store
            self._pairs[address] = entry
        return entry

    def send(self, transfer_id: str, handoff: KVHandoff, address: str | None = None) -> None:
        if address is None:
            raise KVTransferError(f"handoff {transfer_id}: no decode instance address (kv_transfer_params.remote_address)")
        try:
            group, lock = self._pair(address)
            kv = handoff.kv
            meta = json.dumps({"transfer_id": transfer_id, "prompt_token_ids": handoff.prompt_token_ids,
                               "first_token": handoff.first_token,
                               "first_logprobs": None if handoff.first_logprobs is None else
                               {str(k): v for k, v in handoff.first_logprobs.items()},
                               "first_logprob": handoff.first_logprob}).encode()  # fmt: skip
            header = torch.tensor([len(meta), kv.shape[1], kv.shape[2], kv.shape[3], kv.shape[4], _DTYPES.index(kv.dtype),
                                   int(handoff.scales is not None), 0], dtype=torch.int64)  # fmt: skip
            with lock:  # one handoff at a time per pair: the messages of two must not interleave
                group.send([header], 0, 0).wait()
                group.send([torch.frombuffer(bytearray(meta), dtype=torch.uint8)], 0, 0).wait()
                for layer in range(kv.shape[1]):
                    group.send([kv[:, layer].contiguous()], 0, 0).wait()
                    if handoff.scales is not None:
                        group.send([handoff.scales[:, layer].contiguous()], 0, 0).wait()
        except Exception as exc:
            with self._lock:  # a broken pair is rebuilt on the next send
                self._pairs.pop(address, None)
                self._stores.pop(address, None)
            raise KVTransferError(f"handoff {transfer_id} to {address}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self._closed = True
