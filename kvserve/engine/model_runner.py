"""ModelRunner: owns the model, the KV pool tensors and the sampler; turns a SchedulerOutput
into one forward pass and the tokens its sampling positions draw (`execute_model`).

The flat batch puts requests with one new position (decodes, m = 1) first, so their
attention runs as one batched call; requests with m > 1 (prefill chunks, over any cached
history S0) follow as segments with the rectangular causal mask.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.attention.metadata import (
    AttentionMetadata, GroupedMetadata, PrefillSegment, SharedPrefixTensors, context_slots, rectangular_causal_bias,
)
from kvserve.attention.shared_prefix_plan import SharedPrefixRule, find_shared_prefill_prefixes
from kvserve.attention.sliding_window import WindowedRows
from kvserve.distributed.request_layout import RequestShardedMetadata
from kvserve.engine.kv_groups import KVGroups
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, SamplerOutput
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.arch import ModelArchitecture
from kvserve.memory import lazily_zeroed
from kvserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# prompt logprobs: LM-head rows per call (fp32 logits of 256 x a 128k vocabulary: 128 MiB)
_PROMPT_LOGITS_ROWS = 256


@dataclasses.dataclass
class KVPoolLayout:
    num_blocks: int
    block_size: int
    kv_bytes_per_position: int  # c_kv, every layer's, an int8 pool's scales included
    kv_dtype: torch.dtype = torch.bfloat16  # the pools' elements; int8 pools have fp32 scale pools beside them
    # how the layers share blocks (engine/kv_groups.py); None: one group of every layer
    groups: KVGroups | None = None

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == torch.int8

    @property
    def kv_groups(self) -> KVGroups:
        return self.groups if self.groups is not None else KVGroups.single(1)

    @property
    def block_bytes(self) -> int:
        """One block: block_size positions of its group's layer slots (every layer's without groups)."""
        g = self.kv_groups
        if self.groups is None:
            return self.block_size * self.kv_bytes_per_position
        return self.block_size * g.layers_per_block * (self.kv_bytes_per_position // g.num_layers)

    @property
    def num_tokens(self) -> int:
        """Positions the pool holds of requests that keep every layer's KV (any request, without
        windows; one within its windows, with them)."""
        g = self.kv_groups
        return (self.num_blocks - g.reserved_blocks) // g.num_groups * self.block_size

    def max_request_positions(self, chunk: int) -> int:
        """The longest request the pool holds alone, its prompt computed in chunks of at most
        `chunk` positions (a sliding group holds its window and one chunk at most)."""
        g = self.kv_groups
        return g.max_request_positions(self.num_blocks, self.block_size, chunk) if g.windowed else self.num_tokens

    def requests_that_fit(self, num_positions: int) -> int:
        """Requests of `num_positions` (decoding) the pool holds at once."""
        g = self.kv_groups
        held = g.blocks_held(num_positions, self.block_size) if g.windowed else -(-num_positions // self.block_size)
        return (self.num_blocks - g.reserved_blocks) // held if held else 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_kv_pool(
    arch: ModelArchitecture, kv_dtype: torch.dtype, memory_bytes: int, block_size: int, groups: KVGroups | None = None
) -> KVPoolLayout:
    """As many blocks as `memory_bytes` holds (int8: elements and scales): at c_kv per position
    without groups, at a group's layer slots per position with them."""
    if kv_dtype == torch.int8:
        c_kv = arch.kv_int8_bytes_per_position()
    else:
        c_kv = arch.kv_bytes_per_position(torch.empty((), dtype=kv_dtype).element_size())
    if groups is not None and (groups.grouped or groups.windowed):
        per_block = block_size * groups.layers_per_block * (c_kv // arch.num_layers)
    else:
        groups, per_block = None, c_kv * block_size
    return KVPoolLayout(num_blocks=int(memory_bytes // per_block), block_size=block_size, kv_bytes_per_position=c_kv,
                        kv_dtype=kv_dtype, groups=groups)  # fmt: skip


@dataclasses.dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sampling: list[ScheduledRequest]  # in the order of logits_indices (the scheduler output's `sampling`)
    # requests computing their prompt's logprobs: (request, first row, how many rows); row r
    # scores prompt token len(request.prompt_logprobs) + 1 + (r - first row)
    prompt_rows: list[tuple[Request, int, int]] = dataclasses.field(default_factory=list)
    # filled by the forward pass: (request, one entry per row of prompt_rows)
    prompt_logprobs: list[tuple[Request, list[dict[int, float]]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepMessage:
    """What rank 0 sends every other tensor-parallel rank each step: the forward pass's inputs,
    and which rows' logits it will gather (prompt-logprob spans, then the sampling rows), so
    every rank makes the same collective calls in the same order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    has_sampling: bool
    prompt_spans: list[tuple[int, int]]  # (first row, rows) per prompt-logprobs request


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, layout: KVPoolLayout, device: torch.device, shared_prefix_attention: str = "auto",
        shared_prefix_rule: SharedPrefixRule | None = None, tp=None, pool_kv_heads: int | None = None,
        deterministic: bool = False,
    ):
        self.model = model
        # every attention row of a step with prompt chunks through the decode kernel (AttentionMetadata.row_tables)
        self.deterministic = deterministic
        # distributed/group.py TensorParallelGroup (None: one process); rank 0 sends each step's inputs
        self.tp = tp if tp is not None and tp.world > 1 else None
        # "auto": decode rows whose tables start with the same physical blocks run in parts
        # where the rule says so (attention/shared_prefix_plan.py); "off": never
        self.shared_prefix_attention = shared_prefix_attention
        self.shared_prefix_rule = shared_prefix_rule or SharedPrefixRule()
        self.layout = layout
        self.device = device
        arch = model.arch
        # the pools hold this rank's KV heads; every KV head under the requests KV layout (pool_kv_heads)
        shape = (layout.num_blocks, layout.block_size, pool_kv_heads or arch.num_kv_heads, arch.head_dim)
        # one allocation for all layers' K and V: [2, L, blocks, block_size, N_kv, H], in the
        # layout's dtype (the model's, or int8); int8 pools get their scales beside them in a
        # second one, [2, L, blocks, block_size, N_kv] fp32 (kvserve/attention/kv_pool.py quantize_kv).
        # With KV groups (engine/kv_groups.py) a block holds U layer slots, not L: [2, U, ...],
        # and each layer reads its slot through its group's tables
        groups = layout.groups
        slots = groups.layers_per_block if groups is not None else arch.num_layers
        layer_slot = list(groups.layer_slot) if groups is not None else list(range(arch.num_layers))
        self.kv_groups = groups
        # on the CPU the pool's pages are resident once requests write them (memory.lazily_zeroed)
        pool = lazily_zeroed if torch.device(device).type == "cpu" else lambda s, dt: torch.zeros(s, dtype=dt, device=device)
        self.kv_pool = pool((2, slots, *shape), layout.kv_dtype)
        self.kv_scales = None
        pools = [[self.kv_pool[i][s] for s in layer_slot] for i in (0, 1)]
        layer_group = list(groups.layer_group) if groups is not None else None
        if layout.quantized:
            self.kv_scales = pool((2, slots, *shape[:3]), torch.float32)
            scales = [[self.kv_scales[i][s] for s in layer_slot] for i in (0, 1)]
            model.bind_kv_cache(pools[0], pools[1], scales[0], scales[1], kv_groups=layer_group)
        else:
            model.bind_kv_cache(pools[0], pools[1], kv_groups=layer_group)
        # the decode-attention kernel walks block tables itself: no slot lists or masks needed
        self.decode_reads_pool_in_place = model.kernels.decode_attention.enabled
        windows = model.arch.layer_windows
        self.windows = sorted({w for w in windows if w is not None})  # the layers' sliding windows
        # the window of every layer where they all share one (the KV-read counters clip to it)
        self.uniform_window = windows[0] if len(set(windows)) == 1 else None
        # real layers per KV group (GroupedMetadata's averages)
        self.layers_per_group = [list(groups.layer_group).count(g) for g in range(groups.num_groups)] if groups else [arch.num_layers]
        self.sampler = Sampler(model.kernels.op("argmax_rows"))

    def execute_model(
        self, scheduler_output: SchedulerOutput, after_layer: Callable[[int], None] | None = None
    ) -> tuple[StepBatch, SamplerOutput | None]:
        """One step: its batch (the prompt logprobs it computed filled in) and the tokens its
        sampling requests drew, in the scheduler output's `sampling` order (None: none samples).
        `after_layer`: the model's per-layer callback (LlamaForCausalLM.forward)."""
        batch = self.prepare(scheduler_output)
        sampling = [s.request for s in batch.sampling]
        if sampling and self.sampler.plain_greedy(sampling):
            # argmax only: the LM head takes it as it computes, where it can (no logits written)
            return batch, self.sampler.greedy_output(self.execute_greedy(batch, self.sampler.argmax, after_layer))
        logits = self.execute(batch, after_layer)
        return batch, self.sampler(logits, sampling) if sampling else None

    def prepare(self, scheduler_output: SchedulerOutput) -> StepBatch:
        block_tables = scheduler_output.block_tables
        scheduled = scheduler_output.scheduled
        kv_ranks = scheduler_output.kv_ranks
        if kv_ranks is None:
            ordered = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens > 1]
        else:  # the requests KV layout: each rank's rows together, in rank order, decodes first within
            ordered = sorted(scheduled, key=lambda s: (kv_ranks[s.request.request_id], s.num_new_tokens > 1))

        input_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[str, int] = {}  # request id -> its last row in the flat batch
        prompt_rows: list[tuple[Request, int, int]] = []
        for s in ordered:
            req, start, m = s.request, s.request.num_computed_tokens, s.num_new_tokens
            query_start = len(input_ids)
            if req.wants_prompt_logprobs:
                # position p scores prompt token p + 1; those scored already (before a
                # preemption) are not scored again. No position of such a request comes from
                # the prefix cache, so its chunks start at or before the first unscored one.
                first = max(start, len(req.prompt_logprobs))
                end = min(start + m, req.num_prompt_tokens - 1)
                if end > first:
                    prompt_rows.append((req, query_start + first - start, end - first))
            input_ids.extend(req.all_token_ids[start : start + m])
            positions.extend(range(start, start + m))
            last_row[req.request_id] = query_start + m - 1
        # logits rows in the order of the scheduler's sampling requests, whatever the batch's order
        sampling = scheduler_output.sampling
        logits_indices = [last_row[s.request.request_id] for s in sampling]

        if scheduler_output.group_block_tables is not None:  # a table per KV group, a layer reads its group's
            meta = self._grouped_metadata(ordered, scheduler_output.group_block_tables)
        elif kv_ranks is None:
            meta = self._attention_metadata(ordered, block_tables)
        else:
            world = self.tp.world if self.tp is not None else 1
            per_rank = [[s for s in ordered if kv_ranks[s.request.request_id] == r] for r in range(world)]
            meta = RequestShardedMetadata(
                [self._attention_metadata(rows, block_tables) for rows in per_rank],
                [sum(s.num_new_tokens for s in rows) for rows in per_rank],
            )
        return StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            sampling=sampling,
            prompt_rows=prompt_rows,
        )

    def _grouped_metadata(self, ordered: list[ScheduledRequest], group_tables: dict[str, list[list[int]]]) -> GroupedMetadata:
        """One AttentionMetadata per KV group, over its tables, windowed by its window only."""
        groups = self.kv_groups
        metas = [
            self._attention_metadata(ordered, {rid: tables[g] for rid, tables in group_tables.items()},
                                     windows=[] if w is None else [w])
            for g, w in enumerate(groups.group_windows)
        ]  # fmt: skip
        return GroupedMetadata(metas, self.layers_per_group)

    def _attention_metadata(
        self, ordered: list[ScheduledRequest], block_tables: dict[str, list[int]], windows: list[int] | None = None
    ) -> AttentionMetadata:
        """The attention metadata of these requests' rows (decodes first, then prefill chunks),
        query offsets counted from their first row: the whole step, or one rank's rows under
        the requests KV layout (its block tables then index its own pool). `windows`: the
        sliding windows of the layers that read it (default: every window of the model)."""
        bs = self.layout.block_size
        decodes = [s for s in ordered if s.num_new_tokens == 1]
        slot_mapping: list[int] = []
        prefills: list[PrefillSegment] = []
        query_start = 0
        for s in ordered:
            req, start, m = s.request, s.request.num_computed_tokens, s.num_new_tokens
            table = block_tables[req.request_id]
            if m == 1:
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                slots = context_slots(table, start + m, bs)
                slot_mapping.extend(slots[start:].tolist())
                prefills.append(
                    PrefillSegment(
                        query_start=query_start,
                        num_new=m,
                        num_cached=start,
                        context_slots=slots.to(self.device),
                        attn_bias=rectangular_causal_bias(start, m, self.model.dtype).to(self.device) if start else None,
                    )
                )
            query_start += m

        decode_slots = decode_mask = decode_lens = decode_tables = shared_prefix = None
        # a layer with one sliding window (its group's metadata) reads the window only: a chunk's
        # rows see at most W - 1 + m positions between them, a decode row W
        window = windows[0] if windows else (self.uniform_window if windows is None else None)
        reach = (lambda n, m: n) if window is None else (lambda n, m: min(n, window - 1 + m))
        kv_positions_read = sum(reach(seg.num_cached + seg.num_new, seg.num_new) for seg in prefills)
        # several prompt chunks over the same cached prefix read it once; the result is the
        # same bits either way (attention/shared_prefix_plan.py), so no cost rule beyond the flag
        prefill_sharing = None
        if self.shared_prefix_attention == "auto" and len(prefills) > 1:
            prefill_reqs = [s for s in ordered if s.num_new_tokens > 1]
            prefill_sharing = find_shared_prefill_prefixes(
                [block_tables[s.request.request_id] for s in prefill_reqs], [seg.num_cached for seg in prefills], bs
            )
        # --deterministic with prompt chunks: every row through the decode kernel, which reads
        # every history (AttentionMetadata.row_tables)
        row_tables = None
        if self.deterministic and prefills and self.decode_reads_pool_in_place:
            row_tables = self._row_tables(ordered, block_tables)
        windowed = self._windowed_rows(ordered, block_tables, row_tables, self.windows if windows is None else windows)
        if decodes:
            lens_list = [s.request.num_computed_tokens + 1 for s in decodes]
            kv_positions_read += sum(reach(n, 1) for n in lens_list)
            # a plan is built only where this step's attention runs it, so the engine counts
            # what the metadata carries: not under row_tables, and not for fp32 queries on the
            # kernels (they take bf16 ones, over bf16 or int8 pools; the plain decode kernel
            # then reads every history)
            in_place_fp32 = self.decode_reads_pool_in_place and self.model.dtype != torch.bfloat16
            if self.shared_prefix_attention == "auto" and row_tables is None and not in_place_fp32:
                decode_block_lists = [block_tables[s.request.request_id] for s in decodes]
                plan = self.shared_prefix_rule.plan(decode_block_lists, lens_list, bs)
                if plan is not None and self.decode_reads_pool_in_place:
                    shared_prefix = SharedPrefixTensors.for_kernels(plan, self.model.kernels.ops, self.device)
                elif plan is not None:  # the reference path: slots and masks
                    shared_prefix = SharedPrefixTensors.for_reference(plan, decode_block_lists, self.device)
            lens = torch.tensor(lens_list)
            max_len = int(lens.max())
            max_blocks = -(-max_len // bs)
            padded = [block_tables[s.request.request_id][:max_blocks] for s in decodes]
            tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in padded], dtype=torch.long)
            if not self.decode_reads_pool_in_place and shared_prefix is None:  # the reference path gathers slots, then masks
                ctx = torch.arange(max_len)
                decode_slots = (tables[:, ctx // bs] * bs + ctx % bs).to(self.device)
                decode_mask = (ctx.unsqueeze(0) < lens.unsqueeze(1)).view(len(decodes), 1, 1, max_len).to(self.device)
            decode_lens = lens.to(torch.int32).to(self.device)
            decode_tables = tables.to(torch.int32).to(self.device)

        return AttentionMetadata(
            row_tables=row_tables,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decodes=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            decode_context_lens=decode_lens,
            decode_block_tables=decode_tables,
            prefills=prefills,
            shared_prefix=shared_prefix,
            kv_positions_read=kv_positions_read,
            prefill_sharing=prefill_sharing,
            windowed=windowed,
        )

    def _windowed_rows(
        self, ordered: list[ScheduledRequest], block_tables: dict[str, list[int]], row_tables, windows: list[int]
    ) -> dict[int, WindowedRows]:
        """Per sliding window of the model that some row of these requests sees past: its rows
        (attention/sliding_window.py); on the kernels every row as a decode query, on the
        reference path the decode rows' ranges gathered."""
        if not windows or not ordered:
            return {}
        longest = max(s.request.num_computed_tokens + s.num_new_tokens for s in ordered)
        windows = [w for w in windows if longest > w]
        if not windows:
            return {}
        if self.decode_reads_pool_in_place:
            tables, lens = row_tables if row_tables is not None else self._row_tables(ordered, block_tables)
            return {w: WindowedRows.for_kernels(w, tables, lens) for w in windows}
        decodes = [s for s in ordered if s.num_new_tokens == 1]
        decode_tables = [block_tables[s.request.request_id] for s in decodes]
        decode_lens = [s.request.num_computed_tokens + 1 for s in decodes]
        bs = self.layout.block_size
        return {w: WindowedRows.for_reference(w, decode_tables, decode_lens, bs, self.device) for w in windows}

    def _row_tables(self, ordered: list[ScheduledRequest], block_tables: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of these requests as a decode query: its request's block table and its
        context length (position + 1), in row order."""
        bs = self.layout.block_size
        tables: list[tuple[torch.Tensor, int]] = []
        lens: list[torch.Tensor] = []
        for s in ordered:
            start, m = s.request.num_computed_tokens, s.num_new_tokens
            tables.append((torch.tensor(block_tables[s.request.request_id][: -(-(start + m) // bs)], dtype=torch.int32), m))
            lens.append(torch.arange(start + 1, start + m + 1, dtype=torch.int32))
        width = max(t.numel() for t, _ in tables)
        # one table per request, repeated for its rows (a 2,048-row chunk built as Python lists took ~20 ms)
        padded = torch.cat([F.pad(t, (0, width - t.numel())).expand(m, width) for t, m in tables])
        return padded.to(self.device), torch.cat(lens).to(self.device)

    def _forward(self, batch: StepBatch, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        if self.tp is not None:  # the other ranks run the same step on their shares
            self.tp.broadcast_object(StepMessage(
                batch.input_ids, batch.positions, batch.meta, batch.logits_indices, bool(batch.sampling),
                [(row, count) for _, row, count in batch.prompt_rows],
            ))  # fmt: skip
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, after_layer)
        if batch.prompt_rows:
            batch.prompt_logprobs = [
                (req, self._prompt_logprobs(hidden, req, row, count)) for req, row, count in batch.prompt_rows
            ]
        return hidden

    def _prompt_logprobs(self, hidden: torch.Tensor, req: Request, row: int, count: int) -> list[dict[int, float]]:
        """Each row's logprob of the prompt token it predicts, plus the top-k (raw distribution,
        fp32), the LM head run over a few hundred rows at a time to bound the logits' memory."""
        k = req.sampling_params.prompt_logprobs
        first_token = len(req.prompt_logprobs) + 1
        entries: list[dict[int, float]] = []
        for lo in range(0, count, _PROMPT_LOGITS_ROWS):
            n = min(_PROMPT_LOGITS_ROWS, count - lo)
            logprobs = self.model.compute_logits(hidden[row + lo : row + lo + n]).float().log_softmax(dim=-1).cpu()
            targets = req.prompt_token_ids[first_token + lo : first_token + lo + n]
            chosen = logprobs.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
            top = logprobs.topk(k, dim=-1) if k else None
            for i, (token, lp) in enumerate(zip(targets, chosen)):
                entry = {token: lp}
                if top is not None:
                    for t, v in zip(top.indices[i].tolist(), top.values[i].tolist()):
                        entry.setdefault(t, v)
                entries.append(entry)
        return entries

    @torch.inference_mode()
    def run_step_message(self, msg: StepMessage) -> None:
        """A rank other than 0: rank 0's step on this rank's share, with the same logits
        gathers (`_prompt_logprobs` in the same chunks, then the sampling rows)."""
        hidden = self.model(msg.input_ids, msg.positions, msg.meta)
        for row, count in msg.prompt_spans:
            for lo in range(0, count, _PROMPT_LOGITS_ROWS):
                n = min(_PROMPT_LOGITS_ROWS, count - lo)
                self.model.compute_logits(hidden[row + lo : row + lo + n])
        if msg.has_sampling:
            self.model.compute_logits(hidden.index_select(0, msg.logits_indices))

    @torch.inference_mode()
    def execute(self, batch: StepBatch, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One forward pass; returns logits [R, V] (model dtype) for the sampling rows, on the CPU."""
        hidden = self._forward(batch, after_layer)
        if not batch.sampling:
            return torch.empty((0, self.model.arch.vocab_size))
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).cpu()

    def execute_greedy(
        self, batch: StepBatch, argmax: Callable[[torch.Tensor], torch.Tensor], after_layer: Callable[[int], None] | None = None
    ) -> list[int]:
        """One forward pass; the greedy token of each sampling row. The LM head takes the
        argmax as it computes where it can, writing no logits; elsewhere `argmax` (the
        sampler's) takes it from the logits, so both ways give the same tokens."""
        hidden = self._forward(batch, after_layer)
        return self.model.greedy_tokens(hidden.index_select(0, batch.logits_indices), argmax).tolist()
