"""LLMEngine: add requests, step, get outputs. A step reads aloud as schedule, run, update, emit.

The scheduler is the one bookkeeper of request state (`Scheduler.update_from_output` applies
a step; `Scheduler.finish` ends a request); the engine writes no Request field itself. It
owns what the user sees: the grouping of n samples into one output, and the counters.

Synchronous by design; the server drives it from its own thread (engine/async_engine.py),
the offline `LLM` calls `step()` until everything is done.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Sequence

import torch

from kvserve.attention.cascade import SharedPrefixRule
from kvserve.config import EngineConfig
from kvserve.disagg.connector import KVConnector, KVTransferParams
from kvserve.disagg.transport import KV_STALL_ENV, FaultyTransport, SharedMemoryTransport
from kvserve.distributed.fingerprint import model_fingerprint
from kvserve.distributed.group import TensorParallelGroup
from kvserve.distributed.launch import launched_by_torchrun, start_local_ranks
from kvserve.distributed.request_layout import RequestHeads
from kvserve.distributed.shm_allreduce import TWO_SHOT_MIN_ELEMENTS
from kvserve.distributed.sharding import plan_shard, shard_weights
from kvserve.engine.allocator import release_free_memory, tune_malloc
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.kv_events import KVEventLog
from kvserve.engine.kv_placement import RequestShardedKVCache
from kvserve.engine.model_runner import ModelRunner, plan_kv_pool
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import Sampler
from kvserve.engine.scheduler import Scheduler, SchedulerOutput, StepUpdate
from kvserve.errors import ConfigError, InvalidRequestError, PromptTooLongError
from kvserve.kernels.support import KernelSupport
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.quantization import resolve_quantization
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.structured.backend import CompiledGrammar

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Parent:
    """One user request: n samples of one prompt, reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    sent_tokens: list[int]  # per child: output tokens already handed out

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


@dataclasses.dataclass
class EngineCounters:
    """Monotonic totals, for metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    computed_tokens: int = 0  # positions run through the model (prefix-cache hits are not)
    # KV bytes the attention read (positions x c_kv, all layers' K and V): as the step ran,
    # and as a per-request scan of every history would have (equal where no shared prefix
    # was read once: --shared-prefix-attention off, no group, or a path that ignores the plan)
    attention_kv_bytes_read: int = 0
    attention_kv_bytes_read_without_sharing: int = 0
    shared_prefix_steps: int = 0  # steps whose decode attention read shared prefixes once per group


SHM_ALLREDUCE_ELEMENTS = 1 << 20  # fp32 elements per rank's slot: 4 MiB, two buffers of N slots


def _stop_ranks(tp: TensorParallelGroup, procs: list, send_stop: bool) -> None:
    """Rank 0's end of the group: the stop to the other ranks (unless the group is broken),
    leaving it, and the ranks it started joined (killed past 30 s)."""
    try:
        if send_stop and tp.is_driver:
            tp.broadcast_object(None)
    except Exception:  # a rank already gone: it has nothing left to stop
        logger.warning("tensor parallel: the stop did not reach every rank", exc_info=True)
    finally:
        tp.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif config.tensor_parallel_size > 1:
            # the ranks of one host share its cores: more threads than cores make every
            # AllReduce wait on a rank whose threads are descheduled
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        tune_malloc()  # before the weights are loaded: every later buffer follows the same rule
        # tensor parallelism (distributed/): this process is rank 0 unless a launcher said otherwise
        self.tp: TensorParallelGroup | None = None
        self._rank_procs: list = []
        self._finalizer: weakref.finalize | None = None
        tp_notes: list[str] = []
        if config.tensor_parallel_size > 1:
            if launched_by_torchrun():
                self.tp = TensorParallelGroup.from_env(config.torch_device, config.distributed_timeout_s)
            else:
                self._rank_procs, address = start_local_ranks(config)
                self.tp = TensorParallelGroup.join(
                    0, config.tensor_parallel_size, address, config.torch_device, config.distributed_timeout_s
                )
            if self.tp.world != config.tensor_parallel_size:
                raise ConfigError(
                    "tensor_parallel_size", f"{config.tensor_parallel_size} asked, but the launcher started {self.tp.world} ranks"
                )
            one_host = not launched_by_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
            if config.tensor_parallel_allreduce == "auto" and one_host and config.torch_device.type == "cpu":
                # a decode step's [B, D] partial sums fit (the small messages whose latency gloo
                # dominates); a long prefill chunk's larger ones go to gloo
                self.tp.use_shared_memory(SHM_ALLREDUCE_ELEMENTS, config.distributed_timeout_s)
            allreduce = "shared memory" if self.tp.shm is not None else self.tp.backend
            if self.tp.shm is not None and self.tp.shm.two_shot:
                allreduce += f" (ReduceScatter + AllGather from {TWO_SHOT_MIN_ELEMENTS:,} elements)"
            tp_notes.append(f"tensor parallel: rank {self.tp.rank} of {self.tp.world} ({self.tp.backend}; AllReduce: {allreduce})")
            self._finalizer = weakref.finalize(self, _stop_ranks, self.tp, self._rank_procs, True)
        try:
            self._build(config, loaded, tp_notes)
        except BaseException:
            self._abandon_ranks()  # nothing left waiting on a group that will never step
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None, tp_notes: list[str]) -> None:
        """The model, its KV pool, the scheduler and the runner (this rank's share of them)."""
        ops = None
        if config.cpu_kernels and config.torch_device.type == "cpu":
            from kvserve.kernels import cpu_ops

            ops = cpu_ops(config.kernel_level) if config.kernel_level else None
            if self.tp is not None and ops is not None:
                tp_notes.append("tensor parallel: each rank runs the CPU kernels on its share, layer by layer "
                                "(the fused all-layers step has no AllReduce between layers)")  # fmt: skip
        if loaded is None:
            # the weights' format depends on what this machine can run, so it is settled first
            notes: list[str] = list(tp_notes)
            quant_kernel = KernelSupport.quant_linear_choice(config.torch_dtype, config.torch_device, ops)
            mode = resolve_quantization(config.quantization, quant_kernel, notes)
            loaded = load_model(config.model, config.torch_dtype, mode)
            loaded.notes[:0] = notes
        self.format_notes = loaded.notes
        for note in loaded.notes:
            logger.info("weights: %s", note)
        self.model_name = loaded.name
        self.generation_config = loaded.generation_config  # the server's sampling defaults start here
        self.arch = arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        self.model_source = loaded.source
        self.loaded_from_cache = loaded.from_cache
        # this rank's share of the model (the whole of it in one process): its layers' heads
        # and FFN columns, the KV heads its pool holds, its rows of the vocabulary
        rank, world = (self.tp.rank, self.tp.world) if self.tp is not None else (0, 1)
        self.shard = plan_shard(arch, rank, world)
        shard_weights(loaded.weights, arch, self.shard)
        local_arch = self.shard.local_arch(arch)
        # the requests KV layout: this rank's pool holds every KV head of the requests placed
        # on it, and its attention runs with all heads (distributed/request_layout.py)
        self.requests_layout = requests_layout = config.kv_layout == "requests" and world > 1
        attention_arch = dataclasses.replace(local_arch, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads) \
            if requests_layout else local_arch  # fmt: skip

        layout = plan_kv_pool(attention_arch, config.torch_kv_dtype, config.kv_cache_memory, config.block_size)
        if layout.num_blocks < 1:
            need = layout.kv_bytes_per_position * config.block_size
            raise ConfigError("kv_cache_memory", f"{config.kv_cache_memory} bytes hold no block; at least {need} needed")
        model_len = arch.max_position_embeddings
        if arch.sliding_window and arch.sliding_window < model_len:
            model_len = arch.sliding_window  # beyond the window, full attention would differ from the model's
        if config.max_model_len is not None:
            if config.max_model_len > model_len:
                raise ConfigError("max_model_len", f"{config.max_model_len} exceeds the model's context of {model_len}")
            if config.max_model_len > layout.num_tokens:
                raise ConfigError(
                    "max_model_len",
                    f"{config.max_model_len} positions do not fit the KV pool of {layout.num_tokens} "
                    f"({config.kv_cache_memory} bytes); raise kv_cache_memory or lower max_model_len",
                )
            model_len = config.max_model_len
        self.context_len = model_len  # before the pool caps it (the step log's header)
        # one request must always fit the pool alone, so preemption can always make progress
        self.max_model_len = min(model_len, layout.num_tokens)
        self.layout = layout

        # which kernel runs each part of this model, decided once; the model only follows it
        self.kernels = KernelSupport.decide(
            attention_arch, config.torch_dtype, config.torch_device, ops, config.prepack_weights, kv_dtype=layout.kv_dtype,
            deterministic=config.deterministic,
        )
        vocab_sizes = [plan_shard(arch, r, world).vocab for r in range(world)]
        model = LlamaForCausalLM(
            local_arch, loaded.weights, max_positions=self.max_model_len + 1, kernels=self.kernels, tp=self.tp,
            vocab=self.shard.vocab, vocab_sizes=[hi - lo for lo, hi in vocab_sizes],
        )  # fmt: skip
        loaded.weights.clear()
        release_free_memory()  # the load's freed transients, before the pools are allocated
        self.model = model.to(config.torch_device)
        self.model.process_weights_after_loading()
        if config.deterministic:
            self._check_deterministic()
        self.kv_events = KVEventLog() if config.enable_kv_cache_events else None
        if requests_layout:
            self.model.request_heads = RequestHeads.from_shards(
                [plan_shard(arch, r, world) for r in range(world)], arch.num_heads, arch.num_kv_heads, arch.head_dim
            )
            # rank 0 places each request on a rank's pool; each pool has its own prefix cache
            self.kv_cache = RequestShardedKVCache(
                world, layout.num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events
            )
        else:
            self.kv_cache = KVCacheManager(layout.num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events)
        self.connector = None  # built with the runner's pools, below
        self.scheduler = Scheduler(config, self.kv_cache)
        rule = SharedPrefixRule(
            min_shared_blocks=-(-config.shared_prefix_min_positions // config.block_size), min_group_size=config.shared_prefix_min_group
        )
        self.runner = ModelRunner(
            # --deterministic: a decode row read in parts (shared prefix, then suffix, merged) has other bits than read whole
            self.model, layout, config.torch_device, "off" if config.deterministic else config.shared_prefix_attention, rule,
            self.tp, pool_kv_heads=arch.num_kv_heads if requests_layout else None, deterministic=config.deterministic,
        )  # fmt: skip
        if self.tp is None:  # a handoff moves one process's pools (not yet a tensor-parallel group's)
            self.connector = KVConnector(
                self._kv_transport(config), self.runner.kv_pool, self.runner.kv_scales, config.block_size,
                config.kv_transfer_failure, config.kv_transfer_timeout_s, arch.vocab_size,
            )  # fmt: skip
            self.scheduler.connector = self.connector
        if self.tp is not None:
            self._check_ranks_agree()
        self.sampler = Sampler(self.kernels.op("argmax_rows"))
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Parent] = {}
        self.counters = EngineCounters()
        self._next_id = 0
        # --step-log: each step's shape, read from the plan (when `read_step_shapes`: the step log and
        # the in-process calibration), and its duration (record_step)
        self.step_log = None
        self.read_step_shapes = False
        self.last_step_shape = None
        if config.step_log and (self.tp is None or self.tp.is_driver):  # rank 0 runs the steps
            self.read_step_shapes = True
            from kvserve.sim.step_log import StepLog

            self.step_log = StepLog(config.step_log, self.describe_for_step_log())

    def _check_deterministic(self) -> None:
        """--deterministic holds only where every path a row can take sums in one order: the
        decode attention kernel (every attention row goes through it) and batch-invariant
        projections. Anything else is refused, named, rather than silently not deterministic."""
        problems = []
        if not self.kernels.decode_attention.enabled:
            problems.append(f"the decode attention kernel is off ({self.kernels.decode_attention.reason})")
        odd = sorted({kind for kind, lins in self.model.projection_kinds().items() for lin in lins
                      if not lin.method.batch_invariant(lin)})  # fmt: skip
        if odd:
            problems.append(f"these projections run where the summation order depends on the row count: {', '.join(odd)} "
                            "(off the kernels' tile grid, or not bf16/quantized)")  # fmt: skip
        if problems:
            raise ConfigError("deterministic", "cannot hold for this model here: " + "; ".join(problems))

    @staticmethod
    def _kv_transport(config: EngineConfig):
        """How this instance's handoffs travel: /dev/shm files, or torch.distributed point to
        point (a decode instance listens, at kv_transfer_listen or any free loopback port).
        KVSERVE_TEST_KV_STALL_S delays every arriving handoff by that many seconds (the
        failing/stalling test transport, for tests of whole server processes)."""
        if config.kv_transport == "torch":
            from kvserve.disagg.torch_transport import TorchDistributedTransport

            listen = config.kv_transfer_listen
            if listen is None and config.kv_role != "prefill":
                listen = "127.0.0.1:0"
            transport = TorchDistributedTransport(listen)
        else:
            transport = SharedMemoryTransport()
        stall = float(os.environ.get(KV_STALL_ENV) or 0)
        return FaultyTransport(transport, stall_s=stall) if stall > 0 else transport

    # ---- tensor parallelism: the ranks -------------------------------------------------

    def _check_ranks_agree(self) -> None:
        """Every rank built the same engine (model, formats, pool), or all refuse to start
        with what differed: ranks given different files or flags would compute garbage."""
        c = self.config
        mine = {
            "model": str(self.model_name), "model files": model_fingerprint(self.model_source), "arch": self.arch,
            "dtype": str(c.torch_dtype), "kv_dtype": str(self.layout.kv_dtype),
            "blocks": self.layout.num_blocks, "block_size": c.block_size, "max_model_len": self.max_model_len,
            "prefix_caching": c.enable_prefix_caching, "shared_prefix_attention": c.shared_prefix_attention, "kv_layout": c.kv_layout,
        }  # fmt: skip
        everyone = self.tp.gather_objects(mine)
        verdict = None
        if self.tp.is_driver:
            for r, theirs in enumerate(everyone):
                diff = [k for k in mine if theirs.get(k) != mine[k]]
                if diff:
                    verdict = f"rank {r} differs from rank 0 in {', '.join(diff)}: " + "; ".join(
                        f"{k}: {theirs.get(k)!r} vs {mine[k]!r}" for k in diff
                    )
                    break
        verdict = self.tp.broadcast_object(verdict)
        if verdict:
            raise ConfigError("tensor_parallel_size", verdict)

    def follow_steps(self) -> None:
        """A rank other than 0: run each step rank 0 sends on this rank's share, until it stops."""
        assert self.tp is not None and not self.tp.is_driver
        while True:
            msg = self.tp.broadcast_object(None)
            if msg is None:
                return
            self.runner.run_step_message(msg)

    def _abandon_ranks(self) -> None:
        """After a failed start: leave the group and end the ranks this process started (the
        group may be broken: no stop is sent)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            _stop_ranks(self.tp, self._rank_procs, send_stop=False)
        self.tp = None

    def close(self) -> None:
        """Rank 0 stops the other ranks and waits for those it started; then leaves the group.
        Also run when the engine is collected or the interpreter exits, so no rank is left
        waiting for a step that will never come."""
        if self._finalizer is not None:
            self._finalizer()
        self.tp = None
        if self.step_log is not None:
            self.step_log.close()
            self.step_log = None

    # ---- requests in -------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        vocab = self.arch.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})", "prompt")
        return ids

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens, more than max_model_len={self.max_model_len}",
                "prompt",
            )

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | dict | None = None,
    ) -> str:
        params = params or SamplingParams()
        request_id = self.new_request_id() if request_id is None else request_id
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if kv_transfer is not None:
            kv_transfer, params = self._check_kv_transfer(kv_transfer, params)
        params.check_vocab(self.arch.vocab_size)
        grammar = self.compile_structured(params)  # a cache hit when the server compiled it first
        prompt_ids = self.tokenize_prompt(prompt)
        self.check_prompt_length(len(prompt_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children: list[Request] = []
        for i in range(params.n):
            children.append(
                Request(
                    request_id if params.n == 1 else f"{request_id}#{i}",
                    prompt_ids,
                    params,
                    eos_token_ids=self.tokenizer.eos_token_ids,
                    arrival_time=arrival,
                    block_size=self.config.block_size,
                    cache_salt=cache_salt,
                    max_model_len=self.max_model_len,
                    leader=children[0] if i else None,
                    sample_index=i,
                    detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params),
                )
            )
        parent = _Parent(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_ids,
            children=children,
            sent_tokens=[0] * len(children),
        )
        self._parents[request_id] = parent
        for child in children:
            if grammar is not None:  # each sample walks the grammar on its own
                child.structured = grammar.new_matcher()
            self._children[child.request_id] = parent
            if kv_transfer is not None and child.leader is None:  # the first sample takes the handoff; the others its prefix
                kv_transfer.request_id, kv_transfer.prompt_token_ids = child.request_id, prompt_ids
                child.kv_transfer = kv_transfer
            self.scheduler.add_request(child)
        self.counters.prompt_tokens += len(prompt_ids)
        return request_id

    def _check_kv_transfer(self, kv_transfer, params: SamplingParams) -> tuple[KVTransferParams, SamplingParams]:
        """A handoff this instance can take part in; a prefill request stops at its first token."""
        if not isinstance(kv_transfer, KVTransferParams):
            kv_transfer = KVTransferParams.from_dict(kv_transfer)
        if self.connector is None:
            raise InvalidRequestError("kv_transfer_params: handoffs under tensor parallelism are not supported yet", "kv_transfer_params")
        role = self.config.kv_role
        if kv_transfer.do_remote_decode and role == "decode":
            raise InvalidRequestError("kv_transfer_params: this is a decode instance (--role decode); it does not prefill for others",
                                      "kv_transfer_params")  # fmt: skip
        if kv_transfer.do_remote_prefill and role == "prefill":
            raise InvalidRequestError("kv_transfer_params: this is a prefill instance (--role prefill); it does not receive KV",
                                      "kv_transfer_params")  # fmt: skip
        if params.n != 1 and kv_transfer.do_remote_decode:
            raise InvalidRequestError("kv_transfer_params: a prefill for a handoff samples one first token (n = 1)", "n")
        if kv_transfer.do_remote_decode:  # the first token, then the decode side goes on
            params = dataclasses.replace(params, max_tokens=1, min_tokens=0)
        return kv_transfer, params

    def compile_structured(self, params: SamplingParams) -> "CompiledGrammar | None":
        """The compiled grammar of a constrained request (LRU-cached), None when unconstrained.
        Raises InvalidRequestError naming a constraint the grammar library cannot enforce."""
        if params.structured_outputs is None:
            return None
        from kvserve.structured.backend import compile_structured  # llguidance only once needed

        return compile_structured(params.structured_outputs, self.tokenizer, self.arch.vocab_size)

    def set_prompt_text(self, request_id: str, text: str) -> None:
        """Record the prompt's text when it was tokenized elsewhere (the server does that)."""
        self._parents[request_id].prompt = text

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free everything the request holds, at any point of its life; others are untouched."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.is_finished:
                t = child.kv_transfer
                if t is not None and t.waiting and self.connector is not None:
                    self.connector.transport.discard(t.transfer_id)  # a handoff already here goes too
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                self.counters.finished["abort"] += 1
        return self._emit(parent)

    def abandon_handoff(self, transfer_id: str, reason: str, recompute: bool = False) -> None:
        """A decode request's handoff will not come (the router saw its prefill fail): it stops
        waiting at its next step, and computes its prompt here (`recompute`, or the failure
        policy says so) or ends with the reason."""
        if self.connector is None:
            raise InvalidRequestError("this instance takes no KV handoffs (tensor parallelism)", "transfer_id")
        self.connector.abandon(transfer_id, reason, recompute)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (and nothing done) while requests hold blocks."""
        return self.kv_cache.reset_prefix_cache()

    # ---- one step ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if self.read_step_shapes:
            self.last_step_shape = self._shape_of(plan)
        for r in plan.arrived:  # first tokens that came with their KV, and handoffs that failed
            self.counters.generation_tokens += r.num_output_tokens
            if r.is_finished:
                self.counters.finished[r.status.value] += 1
        if plan.is_empty:
            if not plan.arrived and self.scheduler.has_unfinished():
                time.sleep(0.001)  # only requests waiting for their KV: poll again soon, without taking a core
            # a decode request's first token may have arrived with its KV (or its handoff failed)
            return [self._emit(p) for p in {self._children[r.request_id].request_id: self._children[r.request_id]
                                           for r in plan.arrived}.values()]  # fmt: skip
        batch = self.runner.prepare(plan)
        sampling = [s.request for s in batch.sampling]
        saving = self._start_handoffs(plan)
        try:
            if sampling and self.sampler.plain_greedy(sampling):
                # argmax only: the LM head takes it as it computes, where it can (no logits written)
                sampled = self.sampler.greedy_output(self.runner.execute_greedy(batch, self.sampler.argmax))
            else:
                logits = self.runner.execute(batch)
                sampled = self.sampler(logits, sampling) if sampling else None
        finally:
            self.model.layer_hook = None
        update = self.scheduler.update_from_output(plan, sampled)
        self.scheduler.record_prompt_logprobs(batch.prompt_logprobs)
        self._count(plan, update)
        self._count_kv_reads(batch)
        if self.connector is not None:  # prefill requests of a handoff: their prompt's KV goes to the decode side
            for r in update.finished:
                if r.kv_transfer is not None and r.kv_transfer.do_remote_decode and r.status != RequestStatus.FINISHED_ABORTED:
                    self.connector.request_finished(r, plan.block_tables[r.request_id])
            for r in saving:
                if not r.is_finished:  # (a prefill request always ends at its first token)
                    self.connector.cancel_save(r)
        # one output per user request that got a token (its n samples together)
        touched = {p.request_id: p for p in (self._children[r.request_id] for r in (*plan.arrived, *update.sampled))}
        return [self._emit(p) for p in touched.values()]

    def _shape_of(self, plan: SchedulerOutput):
        from kvserve.sim.step_shape import shape_of

        if plan.is_empty:
            return None
        runner = self.runner
        return shape_of(plan, self.config.block_size, runner.shared_prefix_rule if runner.shared_prefix_attention == "auto" else None)

    def describe_for_step_log(self) -> dict:
        """What a step model fitted from this engine's steps needs to know of it."""
        arch, config = self.arch, self.config
        return {
            "model": self.model_name, "num_layers": arch.num_layers, "d_model": arch.hidden_size, "num_kv_heads": arch.num_kv_heads,
            "vocab_size": arch.vocab_size, "kv_bytes_per_position": self.layout.kv_bytes_per_position,
            "model_len": self.context_len, "max_model_len": self.max_model_len,
            "num_kv_positions": self.layout.num_tokens, "block_size": config.block_size,
            "max_num_batched_tokens": config.max_num_batched_tokens, "dtype": str(config.torch_dtype).removeprefix("torch."),
            "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
            "threads": torch.get_num_threads(),
        }  # fmt: skip

    def record_step(self, seconds: float, arrivals: int = 0) -> None:
        """--step-log: the last step took `seconds` from its start to its outputs delivered (the
        caller times it, since delivering is the caller's part), while `arrivals` new requests
        were handled beside it; an empty step is not recorded."""
        if self.step_log is not None and self.last_step_shape is not None:
            shape = self.last_step_shape
            self.step_log.record(dataclasses.replace(shape, arrivals=arrivals) if arrivals else shape, seconds)
            self.last_step_shape = None

    def _start_handoffs(self, plan: SchedulerOutput) -> list[Request]:
        """Prefill requests whose prompt this step completes: their handoffs open now, and each
        layer's K/V go out as soon as the layer has run (the model's layer hook), overlapping
        the send with the rest of the forward pass."""
        if self.connector is None:
            return []
        saving = []
        for s in plan.scheduled:
            r, t = s.request, s.request.kv_transfer
            if s.samples and t is not None and t.do_remote_decode and not r.output_token_ids:
                self.connector.start_save(r, plan.block_tables[r.request_id])
                saving.append(r)
        if saving:
            connector = self.connector
            self.model.layer_hook = lambda layer: [connector.save_kv_layer(layer, r) for r in saving]
        return saving

    def _count(self, plan: SchedulerOutput, update: StepUpdate) -> None:
        counters = self.counters
        counters.steps += 1
        counters.computed_tokens += sum(s.num_new_tokens for s in plan.scheduled)
        counters.generation_tokens += len(update.sampled)
        for req in update.finished:
            counters.finished[req.status.value] += 1
            if self.step_log is not None:
                self.step_log.record_request(req)

    def _count_kv_reads(self, batch) -> None:
        meta, c_kv = batch.meta, self.layout.kv_bytes_per_position
        counters = self.counters
        counters.attention_kv_bytes_read_without_sharing += meta.kv_positions_read * c_kv
        counters.attention_kv_bytes_read += meta.kv_positions_read_with_sharing() * c_kv
        if meta.cascade is not None and meta.cascade.applied:
            counters.shared_prefix_steps += 1

    def _emit(self, parent: _Parent) -> RequestOutput:
        # O(new tokens) per step: the deltas are sliced fresh; the whole output (token ids,
        # logprobs) is handed over once, on the final output, as the finished requests' own
        # lists (nothing appends to them any more), never copied each step
        finished = parent.finished
        first = not any(parent.sent_tokens)
        outputs = []
        for i, child in enumerate(parent.children):
            detok = child.detokenizer
            start = parent.sent_tokens[i]
            parent.sent_tokens[i] = child.num_output_tokens
            want_logprobs = child.sampling_params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=detok.output_text,
                    token_ids=child.output_token_ids if finished else [],
                    cumulative_logprob=child.cumulative_logprob if want_logprobs else None,
                    logprobs=(child.logprobs if finished else None) if want_logprobs else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    delta_text=detok.take_delta(child.is_finished),
                    delta_token_ids=child.output_token_ids[start:],
                    delta_logprobs=child.logprobs[start:] if want_logprobs else None,
                    num_tokens=child.num_output_tokens,
                )
            )
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._children.pop(child.request_id, None)
        lead = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=parent.children[0].num_cached_tokens,
            timings=[c.timing for c in parent.children],
            # complete once the first token is out (the prompt is computed by then); handed
            # over on the first output and the final one, uncopied
            prompt_logprobs=lead.prompt_logprobs if lead.sampling_params.prompt_logprobs is not None and (first or finished) else None,
            kv_transfer_params=self._handoff_result(lead) if finished and lead.kv_transfer is not None else None,
        )

    def _handoff_result(self, request: Request) -> dict:
        """What a finished request of a handoff reports: for the prefill side, what the
        decode side is to be given; for the decode side, how its KV came."""
        t = request.kv_transfer
        if t.do_remote_decode:
            return {"do_remote_prefill": True, "transfer_id": t.transfer_id, "num_positions": request.num_prompt_tokens,
                    "bytes": t.sent_bytes, "seconds": t.send_seconds, "seconds_after_first_token": t.finish_wait_seconds,
                    "transport": self.connector.transport.name, "error": t.error}  # fmt: skip
        return {"transfer_id": t.transfer_id, "loaded": t.loaded, "into_blocks": t.into_blocks, "recomputed": t.recomputed,
                "error": t.error}  # fmt: skip

    # ---- introspection -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def describe(self) -> str:
        """The start-up report: model, dtype, KV pool size and c_kv, then which kernel runs each
        part of the model and why (KernelSupport), and each projection's linear method."""
        layout = self.layout
        return (
            f"model {self.model_name} ({self.arch.architecture}, {self.arch.num_layers} layers, "
            f"{self.arch.num_heads} query / {self.arch.num_kv_heads} KV heads, g={self.arch.queries_per_kv_head}) "
            f"dtype {str(self.model.dtype).removeprefix('torch.')} on {self.config.torch_device}"
            f"{' (kvserve CPU kernels)' if self.uses_cpu_kernels else ''}; "
            f"KV cache: {str(layout.kv_dtype).removeprefix('torch.')}"
            f"{' (fp32 scale per position and KV head)' if layout.quantized else ''}, "
            f"{layout.num_blocks} blocks x {layout.block_size} = {layout.num_tokens} tokens, "
            f"c_kv {layout.kv_bytes_per_position} bytes/position, {layout.nbytes / 2**20:.1f} MiB; "
            f"max_model_len {self.max_model_len}; loaded in {self.load_seconds:.1f}s"
            f"{' (cached weights)' if self.loaded_from_cache else ''}\n"
            f"{self.tensor_parallel_line()}"
            + ("deterministic: every attention row through the decode kernel, projections in one summation order, "
               "shared-prefix attention off (docs/deterministic.md)\n" if self.config.deterministic else "")
            + f"{self.kernels.describe()}\n{self.model.describe_projections()}"
            + "".join(f"\n  note: {note}" for note in self.format_notes)
        )

    def tensor_parallel_line(self) -> str:
        """Under tensor parallelism, this rank's share: heads, KV heads (and how many ranks hold
        each, or the requests layout's whole requests), FFN columns, vocabulary rows, weight
        bytes and c_kv per rank; else nothing."""
        sh = self.shard
        if sh.world == 1:
            return ""
        per_request = self.layout.kv_bytes_per_position * self.max_model_len
        stored, resident = self.model.stored_weight_bytes(), self.model.weight_bytes()
        held = "" if resident == stored else f" ({resident:,} held, with the kernels' packed copies)"
        if self.requests_layout:
            kv = (f"KV layout requests: all {self.arch.num_kv_heads} KV heads of the requests placed on this rank "
                  "(none replicated; Q and attention outputs exchanged per layer)")  # fmt: skip
        else:
            kv = (f"KV heads [{sh.kv_heads[0]}, {sh.kv_heads[1]}) (each held by {sh.kv_replication} rank"
                  f"{'s' if sh.kv_replication > 1 else ''})")  # fmt: skip
        return (
            f"tensor parallel rank {sh.rank} of {sh.world}: query heads [{sh.q_heads[0]}, {sh.q_heads[1]}), {kv}, "
            f"FFN [{sh.ffn[0]}, {sh.ffn[1]}), vocabulary [{sh.vocab[0]}, {sh.vocab[1]}); "
            f"per rank: weights {stored:,} bytes{held}, KV {self.layout.kv_bytes_per_position:,} bytes/position, "
            f"{per_request:,} bytes per request of max_model_len\n"
        )

    def release(self) -> None:
        """Let go of the model and the KV pool (a failed engine, before a new one is built);
        the engine cannot step afterwards. Counters and the tokenizer stay readable."""
        self.model = None
        self.runner = None

    @property
    def uses_cpu_kernels(self) -> bool:
        return self.kernels.ops is not None
