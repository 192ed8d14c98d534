"""The KV connector: how a request's KV leaves one instance and arrives at another.

Two halves, in the shape of vLLM's KV connector v1 (written anew):

- the scheduler half decides: how many of a request's tokens arrive from elsewhere
  (`get_num_new_matched_tokens`), whether a request still waits for its KV
  (`request_waits`), what to do once its blocks are allocated (`update_state_after_alloc`),
  and whether a finished request's blocks must outlive it (`request_finished`);
- the worker half moves the bytes between the KV pools and the transport: `start_load_kv`
  and `wait_for_layer_load` on the receiving side, `save_kv_layer` and `wait_for_save` on
  the sending side.

A prefill request (`do_remote_decode`) runs to its first token. In the forward pass that
completes its prompt, each layer's K/V are saved as soon as that layer is done, and a
streaming transport sends them while the next layers compute; the first token follows. A decode request (`do_remote_prefill`)
waits, without holding blocks, until its handoff has arrived. It then takes the first
token as its own, allocates blocks for the prompt (a local prefix-cache hit is kept, and only
the rest is loaded), loads the KV into them and goes on decoding from position P.

A handoff that fails or times out is handled per `failure`. `recompute`: the decode side
computes the prompt itself (the same tokens, later). `fail`: the request ends as aborted with
the reason in `request.kv_transfer.error`, which the server answers as a 5xx.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvserve.disagg.handoff import KVHandoff
from kvserve.disagg.transport import KVTransferError, KVTransport, check_transfer_id
from kvserve.errors import InvalidRequestError

FAILURE_POLICIES = ("recompute", "fail")


@dataclasses.dataclass
class KVTransferParams:
    """A request's part in a handoff (the OpenAI body's `kv_transfer_params`)."""

    transfer_id: str
    do_remote_decode: bool = False  # this instance prefills and sends
    do_remote_prefill: bool = False  # this instance receives and decodes
    remote_address: str | None = None  # the decode instance's transfer address (the torch transport)
    # the receiving side's progress
    arrived: KVHandoff | None = dataclasses.field(default=None, repr=False)
    loaded: bool = False
    recomputed: bool = False  # the handoff failed and the prompt was computed here instead
    error: str | None = None
    since: float = dataclasses.field(default_factory=time.monotonic)
    # the sending side's result, for the response
    sent_bytes: int = 0
    send_seconds: float = 0.0  # from the forward pass's start to the handoff delivered
    finish_wait_seconds: float = 0.0  # of which after the first token: what overlapping with the prefill did not hide

    @classmethod
    def from_dict(cls, data) -> "KVTransferParams":
        if not isinstance(data, dict):
            raise InvalidRequestError("kv_transfer_params must be an object", "kv_transfer_params")
        decode, prefill = bool(data.get("do_remote_decode")), bool(data.get("do_remote_prefill"))
        if decode == prefill:
            raise InvalidRequestError("kv_transfer_params needs exactly one of do_remote_decode and do_remote_prefill",
                                      "kv_transfer_params")  # fmt: skip
        address = data.get("remote_address")
        if address is not None and not isinstance(address, str):
            raise InvalidRequestError("kv_transfer_params.remote_address must be a HOST:PORT string", "kv_transfer_params")
        return cls(check_transfer_id(data.get("transfer_id")), do_remote_decode=decode, do_remote_prefill=prefill,
                   remote_address=address)  # fmt: skip

    @property
    def waiting(self) -> bool:
        return self.do_remote_prefill and not self.loaded and self.error is None


class KVConnector:
    def __init__(self, transport: KVTransport, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, block_size: int,
                 failure: str = "recompute", timeout_s: float = 60.0):  # fmt: skip
        if failure not in FAILURE_POLICIES:
            raise ValueError(f"failure must be one of {FAILURE_POLICIES}, got {failure!r}")
        self.transport = transport
        self.kv_pool = kv_pool  # [2, L, blocks, block_size, N_kv, H]
        self.kv_scales = kv_scales  # [2, L, blocks, block_size, N_kv] fp32, int8 pools only
        self.block_size = block_size
        self.failure = failure
        self.timeout_s = timeout_s
        self._saving: dict[str, dict] = {}  # prefill requests being sent: request id -> buffer, send
        # totals, for metrics
        self.sent = self.received = self.failed = 0
        self.bytes_sent = self.bytes_received = 0

    # ---- the scheduler half ------------------------------------------------------------

    def request_waits(self, request) -> bool:
        """A decode request whose handoff has not arrived: poll once, without blocking.
        On failure or timeout, `kv_transfer.error` is set and it no longer waits."""
        t = request.kv_transfer
        if t is None or not t.waiting or t.arrived is not None:
            return False
        try:
            handoff = self.transport.poll(t.transfer_id)
            if handoff is None and time.monotonic() - t.since > self.timeout_s:
                raise KVTransferError(f"handoff {t.transfer_id} did not arrive within {self.timeout_s:g} s")
        except KVTransferError as exc:
            t.error = str(exc)
            self.failed += 1
            return False
        if handoff is None:
            return True
        if handoff.prompt_token_ids != request.prompt_token_ids:
            t.error = f"handoff {t.transfer_id} is for another prompt"
            self.failed += 1
            return False
        if tuple(handoff.kv.shape[:2]) != tuple(self.kv_pool.shape[:2]) or handoff.kv.shape[3:] != self.kv_pool.shape[4:] \
                or handoff.kv.dtype != self.kv_pool.dtype:  # fmt: skip
            t.error = f"handoff {t.transfer_id} has KV of shape {tuple(handoff.kv.shape)} {handoff.kv.dtype}, not this model's"
            self.failed += 1
            return False
        t.arrived = handoff
        self.received += 1
        self.bytes_received += handoff.nbytes
        return False

    def get_num_new_matched_tokens(self, request, num_computed: int) -> int:
        """Positions beyond `num_computed` (the local prefix-cache hit) that arrive from
        elsewhere: the rest of the prompt, once the handoff is here; else 0."""
        t = request.kv_transfer
        if t is None or t.arrived is None or t.loaded:
            return 0
        remote = max(0, t.arrived.num_positions - num_computed)
        if remote == 0:  # this instance's prefix cache holds the whole prompt: nothing to load
            t.loaded, t.arrived = True, None
        return remote

    def update_state_after_alloc(self, request, block_ids: list[int], num_computed: int) -> None:
        """Blocks are allocated: load positions [num_computed, P) into them (every layer)."""
        self.start_load_kv(request, block_ids, num_computed)
        for layer in range(self.kv_pool.shape[1]):
            self.wait_for_layer_load(layer)
        request.kv_transfer.loaded = True
        request.kv_transfer.arrived = None  # the pool has it now

    def request_finished(self, request, block_ids: list[int]) -> bool:
        """A prefill request finished with its first token: its prompt's KV goes out (the
        layers the forward pass already saved, and any it did not). Returns whether its
        blocks must outlive it: no, `wait_for_save` returns once the handoff is delivered."""
        t = request.kv_transfer
        if t is None or not t.do_remote_decode or not request.output_token_ids:
            self.cancel_save(request)
            return False
        if request.request_id not in self._saving:
            self.start_save(request, block_ids)
        t.sent_bytes = self.wait_for_save(request)
        return False

    # ---- the worker half ---------------------------------------------------------------

    def _slots(self, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        return blocks, positions % self.block_size

    def start_load_kv(self, request, block_ids: list[int], num_computed: int) -> None:
        t = request.kv_transfer
        self._loading = (t.arrived, *self._slots(block_ids, num_computed, t.arrived.num_positions), num_computed)

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer `layer`'s K and V of the arrived positions are in the pool."""
        handoff, blocks, offsets, start = self._loading
        for kv in (0, 1):
            self.kv_pool[kv, layer, blocks, offsets] = handoff.kv[kv, layer, start:]
            if self.kv_scales is not None and handoff.scales is not None:
                self.kv_scales[kv, layer, blocks, offsets] = handoff.scales[kv, layer, start:]

    def start_save(self, request, block_ids: list[int]) -> None:
        """Before the forward pass that computes the rest of a prefill request's prompt: a
        buffer for its P positions and a send the layers stream into as they are done."""
        t = request.kv_transfer
        P, pool = request.num_prompt_tokens, self.kv_pool
        kv = torch.empty((2, pool.shape[1], P, *pool.shape[4:]), dtype=pool.dtype)
        scales = None if self.kv_scales is None else torch.empty((2, pool.shape[1], P, pool.shape[4]), dtype=torch.float32)
        state = {"slots": self._slots(block_ids, 0, P), "kv": kv, "scales": scales, "saved": set(), "start": time.perf_counter()}
        try:
            state["send"] = self.transport.open_send(t.transfer_id, t.remote_address, kv, scales)
        except KVTransferError as exc:
            state["send"], t.error = None, str(exc)
        self._saving[request.request_id] = state

    def save_kv_layer(self, layer: int, request) -> None:
        """Layer `layer` is computed: copy its K and V of the prompt's positions out of the
        pool, and let the transport send them while the next layers run."""
        s = self._saving[request.request_id]
        blocks, offsets = s["slots"]
        for kv in (0, 1):
            s["kv"][kv, layer] = self.kv_pool[kv, layer, blocks, offsets]
            if s["scales"] is not None:
                s["scales"][kv, layer] = self.kv_scales[kv, layer, blocks, offsets]
        s["saved"].add(layer)
        if s["send"] is not None:
            s["send"].layer_ready(layer)

    def cancel_save(self, request) -> None:
        s = self._saving.pop(request.request_id, None)
        if s is not None and s["send"] is not None:
            s["send"].cancel()

    def wait_for_save(self, request) -> int:
        """Finish the send with the first token; the bytes sent (0 if it failed)."""
        s = self._saving[request.request_id]
        for layer in range(self.kv_pool.shape[1]):  # a step that ran no hook (the fused decode path) saves here
            if layer not in s["saved"]:
                self.save_kv_layer(layer, request)
        del self._saving[request.request_id]
        t = request.kv_transfer
        if s["send"] is None:  # opening the send failed: t.error says why
            self.failed += 1
            return 0
        want_logprobs = request.sampling_params.logprobs is not None and request.logprobs
        handoff = KVHandoff(
            prompt_token_ids=request.prompt_token_ids, first_token=request.output_token_ids[0], kv=s["kv"], scales=s["scales"],
            first_logprobs=request.logprobs[0] if want_logprobs else None,
            first_logprob=request.cumulative_logprob if want_logprobs else 0.0,
        )  # fmt: skip
        waited = time.perf_counter()
        try:
            s["send"].finish(handoff)
        except KVTransferError as exc:
            t.error = str(exc)
            self.failed += 1
            return 0
        done = time.perf_counter()
        t.send_seconds, t.finish_wait_seconds = done - s["start"], done - waited
        self.sent += 1
        self.bytes_sent += handoff.nbytes
        return handoff.nbytes
