"""The KV connector: how a request's KV leaves one instance and arrives at another.

Two halves, in the shape of vLLM's KV connector v1 (written anew):

- the scheduler half decides: how many of a request's tokens arrive from elsewhere
  (`get_num_new_matched_tokens`), whether a request still waits for its KV
  (`request_waits`), what to do once its blocks are allocated (`update_state_after_alloc`),
  and whether a finished request's blocks must outlive it (`request_finished`);
- the worker half moves the bytes between the KV pools and the transport: `start_load_kv`
  and `wait_for_layer_load` on the receiving side, `save_kv_layer` and `wait_for_save` on
  the sending side;
- the engine step's part: `start_step` before the forward pass (the handoffs its prefill
  requests complete open, and `save_layer`, the model's layer hook, sends each layer as it is
  done), `end_step` after the update (finished prefill requests' handoffs complete with their
  first token), and `handoff_result`, what a finished request of a handoff reports.

A prefill request (`do_remote_decode`) runs to its first token. In the forward pass that
completes its prompt, each layer's K/V are saved as soon as that layer is done, and a
streaming transport sends them while the next layers compute; the first token follows. A
decode request (`do_remote_prefill`) has its blocks allocated first, for every prompt position
and the first token's (a local prefix-cache hit is kept, and only the rest is expected), and
then waits for its KV without computing anything. A transport that receives layer by layer
(torch.distributed) writes each layer straight into those blocks as it arrives; one that
stages whole handoffs (shared memory) has them copied in on arrival. The blocks become
findable by the prefix cache only once loaded. The request then takes the first token as its
own and goes on decoding from position P.

A handoff that fails, times out, or that the router says will not come (`abandon`: its
prefill failed) frees the blocks and is handled per `failure`. `recompute`: the decode side
computes the prompt itself (the same tokens, later). `fail`: the request ends as aborted with
the reason in `request.kv_transfer.error`, which the server answers as a 5xx.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from kvserve.disagg.handoff import KVHandoff
from kvserve.disagg.transport import BlockSink, KVTransferError, KVTransport, SharedMemoryTransport, check_transfer_id
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
    request_id: str = ""
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list, repr=False)
    allocated: bool = False  # its blocks are allocated (before anything arrives)
    arrived: KVHandoff | None = dataclasses.field(default=None, repr=False)  # until its first token is taken
    loaded: bool = False
    into_blocks: bool = False  # the transport wrote it straight into the blocks (no staged copy)
    must_recompute: bool = False  # the router said no prefill instance took it: compute it here whatever the policy
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


def open_transport(config) -> KVTransport:
    """How this instance's handoffs travel (`config.kv_transport`): /dev/shm files, or
    torch.distributed point to point (a decode instance listens, at kv_transfer_listen or any
    free loopback port)."""
    if config.kv_transport == "torch":
        from kvserve.disagg.torch_transport import TorchDistributedTransport

        listen = config.kv_transfer_listen
        if listen is None and config.kv_role != "prefill":
            listen = "127.0.0.1:0"
        return TorchDistributedTransport(listen)
    return SharedMemoryTransport()


class KVConnector:
    def __init__(self, transport: KVTransport, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, block_size: int,
                 skip_draw: Callable, failure: str = "recompute", timeout_s: float = 60.0):  # fmt: skip
        if failure not in FAILURE_POLICIES:
            raise ValueError(f"failure must be one of {FAILURE_POLICIES}, got {failure!r}")
        self.transport = transport
        self.kv_pool = kv_pool  # [2, L, blocks, block_size, N_kv, H]
        self.kv_scales = kv_scales  # [2, L, blocks, block_size, N_kv] fp32, int8 pools only
        self.block_size = block_size
        # skip_draw(request): its generator moves past the first token's draw, made on the prefill side (the engine's sampler)
        self.skip_draw = skip_draw
        self.failure = failure
        self.timeout_s = timeout_s
        self._saving: dict[str, dict] = {}  # prefill requests being sent: request id -> buffer, send
        self._streaming: list = []  # prefill requests whose layers this step's forward pass sends (`save_layer`)
        self._loading: dict[str, BlockSink] = {}  # decode requests with blocks, waiting: request id -> where their KV goes
        # handoffs the router says will not come (their prefill failed), kept until a request takes them:
        # transfer id -> (why, since, whether to compute the prompt here whatever the policy)
        self._abandoned: dict[str, tuple[str, float, bool]] = {}
        self._swept = time.monotonic()
        # totals, for metrics
        self.sent = self.received = self.failed = 0
        self.bytes_sent = self.bytes_received = 0

    # ---- the scheduler half ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed: int) -> int:
        """Positions beyond `num_computed` (the local prefix-cache hit) that arrive from
        elsewhere for a decode request: the rest of its prompt. Its blocks for them are
        allocated before anything arrives (`update_state_after_alloc`)."""
        t = request.kv_transfer
        if t is None or not t.waiting:
            return 0
        return request.num_prompt_tokens - num_computed

    def update_state_after_alloc(self, request, block_ids: list[int], num_computed: int) -> None:
        """The decode request's blocks are allocated: the handoff's positions [num_computed, P)
        go into them, written by the transport as they arrive where it can, else copied in
        once the whole handoff is here."""
        t = request.kv_transfer
        blocks, offsets = self._slots(block_ids, num_computed, request.num_prompt_tokens)
        sink = BlockSink(self.kv_pool, self.kv_scales, blocks, offsets, num_computed, request.num_prompt_tokens)
        self._loading[request.request_id] = sink
        t.allocated = True
        self.transport.expect(t.transfer_id, sink)

    def request_waits(self, request) -> bool:
        """A decode request whose handoff is not in its blocks yet: poll once, without
        blocking. On arrival the KV is loaded and `kv_transfer.arrived` holds the first token;
        on failure or timeout `kv_transfer.error` says why. Either way it no longer waits."""
        t = request.kv_transfer
        if t is None or not t.waiting or t.arrived is not None:
            return False
        try:
            handoff = self._poll(t)
        except KVTransferError as exc:
            t.error = str(exc)
            self.failed += 1
            self.request_released(request)
            return False
        if handoff is None:
            return True
        t.arrived = handoff
        t.loaded, t.into_blocks = True, handoff.in_blocks
        self.skip_draw(request)  # the first token was drawn on the prefill side
        self.request_released(request)
        self.received += 1
        self.bytes_received += handoff.nbytes
        return False

    def _poll(self, t: KVTransferParams) -> KVHandoff | None:
        if time.monotonic() - self._swept > min(self.timeout_s, 10.0):  # handoffs nobody will take, now and then
            self._swept = time.monotonic()
            self.transport.sweep(2 * self.timeout_s)
        abandoned = self._abandoned.pop(t.transfer_id, None)
        if abandoned is not None:
            t.must_recompute = abandoned[2]
            raise KVTransferError(f"handoff {t.transfer_id} will not come: {abandoned[0]}")
        handoff = self.transport.poll(t.transfer_id)
        if handoff is None:
            if time.monotonic() - t.since > self.timeout_s:
                raise KVTransferError(f"handoff {t.transfer_id} did not arrive within {self.timeout_s:g} s")
            return None
        if handoff.prompt_token_ids != t.prompt_token_ids:
            raise KVTransferError(f"handoff {t.transfer_id} is for another prompt")
        if not handoff.in_blocks:  # staged by the transport: checked, then copied into the blocks
            pool = self.kv_pool
            if tuple(handoff.kv.shape[:2]) != tuple(pool.shape[:2]) or handoff.kv.shape[3:] != pool.shape[4:] \
                    or handoff.kv.dtype != pool.dtype or (handoff.scales is None) != (self.kv_scales is None):  # fmt: skip
                raise KVTransferError(f"handoff {t.transfer_id} has KV of shape {tuple(handoff.kv.shape)} {handoff.kv.dtype}, "
                                      "not this model's")  # fmt: skip
            sink = self._loading.get(t.request_id)
            if sink is not None:
                sink.load(handoff)
        return handoff

    def abandon(self, transfer_id: str, reason: str, recompute: bool = False) -> None:
        """The handoff will not come (the router saw its prefill fail): the request waiting for
        it stops waiting now rather than at the timeout. `recompute`: it computes its prompt
        here whatever the failure policy (no prefill instance even tried)."""
        now = time.monotonic()
        for tid in [k for k, (_, since, _) in self._abandoned.items() if now - since > self.timeout_s]:
            del self._abandoned[tid]  # for requests that never came
        self._abandoned[check_transfer_id(transfer_id)] = (reason, now, recompute)

    def request_released(self, request) -> None:
        """The decode request's blocks no longer take its handoff (loaded, failed, finished or
        aborted): the transport stops writing into them before they can go to another request."""
        if self._loading.pop(request.request_id, None) is not None:
            self.transport.unexpect(request.kv_transfer.transfer_id)

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

    # ---- the engine step's part --------------------------------------------------------

    def start_step(self, plan) -> None:
        """Prefill requests whose prompt this step (a SchedulerOutput) completes: their handoffs
        open now, and each layer's K/V go out as soon as the layer has run (`save_layer`),
        overlapping the send with the rest of the forward pass."""
        self._streaming = []
        for s in plan.scheduled:
            r, t = s.request, s.request.kv_transfer
            if s.samples and t is not None and t.do_remote_decode and not r.output_token_ids:
                self.start_save(r, plan.block_tables[r.request_id])
                self._streaming.append(r)

    def save_layer(self, layer: int) -> None:
        """The model's layer hook: layer `layer` of this step is computed."""
        for r in self._streaming:
            self.save_kv_layer(layer, r)

    def end_step(self, plan, finished: list) -> None:
        """After the step's update: its finished prefill requests' KV goes to the decode side
        with their first token; a send the step opened for a request it did not finish (a
        prefill request always ends at its first token) is cancelled."""
        for r in finished:
            if r.kv_transfer is not None and r.kv_transfer.do_remote_decode and r.finish_reason != "abort":
                self.request_finished(r, plan.block_tables[r.request_id])
        for r in self._streaming:
            if not r.is_finished:
                self.cancel_save(r)
        self._streaming = []

    def handoff_result(self, request) -> dict:
        """What a finished request of a handoff reports: for the prefill side, what the
        decode side is to be given; for the decode side, how its KV came."""
        t = request.kv_transfer
        if t.do_remote_decode:
            return {"do_remote_prefill": True, "transfer_id": t.transfer_id, "num_positions": request.num_prompt_tokens,
                    "bytes": t.sent_bytes, "seconds": t.send_seconds, "seconds_after_first_token": t.finish_wait_seconds,
                    "transport": self.transport.name, "error": t.error}  # fmt: skip
        return {"transfer_id": t.transfer_id, "loaded": t.loaded, "into_blocks": t.into_blocks, "recomputed": t.recomputed,
                "error": t.error}  # fmt: skip

    # ---- the worker half ---------------------------------------------------------------

    def _slots(self, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        return blocks, positions % self.block_size

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
