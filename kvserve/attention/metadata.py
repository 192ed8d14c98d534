"""What one forward step's attention needs to know, built once per step and shared by all layers.

The flat token batch is ordered decodes first (one new position each), then prefill segments
(a whole prompt, or a chunk over cached history). For every request, `S0` positions are
already cached and `m` are new; the new K/V go to `slot_mapping` before anything attends.
Decode rows that share a cached prefix carry the step's shared-prefix plan in the form
their attention path reads (`SharedPrefixTensors`).
"""

from __future__ import annotations

import dataclasses

import torch

from typing import TYPE_CHECKING

from kvserve.attention.shared_prefix_plan import SharedPrefixPlan, kv_positions_read

if TYPE_CHECKING:
    from kvserve.attention.sliding_window import WindowedRows


@dataclasses.dataclass
class PrefillSegment:
    query_start: int  # offset of this request's first new token in the flat batch
    num_new: int  # m
    num_cached: int  # S0
    context_slots: torch.Tensor  # [S0 + m] slot of every visible position, in order
    # [m, S0 + m] additive mask (0 visible, -inf hidden), built once per step for all layers;
    # None when S0 = 0, where the plain causal mask applies
    attn_bias: torch.Tensor | None


@dataclasses.dataclass
class FreshGroup:
    """Whole prompts (S0 = 0) of one length m, adjacent in the flat batch: one batched causal
    SDPA call serves them all (a step of 16 prompts of 128 tokens made 16 calls per layer,
    and their Python overhead cost more than the attention itself)."""

    query_start: int
    num_segments: int
    num_new: int
    slots: torch.Tensor  # [num_segments * m], the segments' new slots in order


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int
    # Decode requests, batched: each row lists the slots of its S0 + 1 positions, padded to
    # the longest with slot 0 and masked out.
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool (True = visible)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32, S0 + 1
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32, for in-place kernels
    prefills: list[PrefillSegment]
    # decode rows grouped by shared prefix blocks (attention/shared_prefix_plan.py), when the
    # engine's --shared-prefix-attention and its rule say so, built only where this step's
    # attention runs it; None: every row reads its history alone
    shared_prefix: SharedPrefixTensors | None = None
    # positions (all layers' K and V, c_kv each) this step's attention reads scanning every
    # request's history alone: Σ decode context lengths + Σ prefill segments' S0 + m
    kv_positions_read: int = 0
    # prefill segments over a shared cached prefix (attention/shared_prefix_plan.py
    # find_shared_prefill_prefixes): per segment (leader, shared_len), the leader's positions
    # [0, shared_len) read once for all its members; None: every segment reads its own
    prefill_sharing: list[tuple[int, int]] | None = None
    # --deterministic with prompt chunks in the step: every row of the step as a decode query,
    # in row order: ([T, max_blocks] int32 block tables, [T] int32 context lengths). Attention
    # then runs every row through the decode kernel, so a position's result is the same
    # whether it is decoded or inside any chunk of a prompt. None: rows go by their kind
    row_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    # per sliding window W of the model's layers, where some row of the step sees past W (or
    # always under --deterministic): that window's rows (attention/sliding_window.py). A window
    # absent here hides nothing this step, and its layers run as global ones
    windowed: dict[int, "WindowedRows"] = dataclasses.field(default_factory=dict)
    _groups: tuple[list[FreshGroup], list[PrefillSegment]] | None = dataclasses.field(default=None, repr=False)
    _kernel_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = dataclasses.field(default=None, repr=False)

    def kv_positions_read_with_sharing(self) -> int:
        """What the step actually read: prompt chunks over a shared cached prefix read it once
        per group; with a decode plan, each shared level once per group and the suffixes."""
        plan = self.shared_prefix.plan if self.shared_prefix is not None else None
        return kv_positions_read(self.kv_positions_read, plan, self.prefill_sharing)

    def prefill_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the prefill kernel reads (`ops.paged_prefill_attention`): every segment's
        context slots back to back (int64), per segment (query_start, m, S0, offset of its
        slots) as an int64 [n, 4], and the shared prefixes as int64 [n, 2] (leader,
        shared_len), or None. Built on the first layer's call and kept for the others."""
        if self._kernel_args is None:
            rows, offset = [], 0
            for seg in self.prefills:
                rows.append((seg.query_start, seg.num_new, seg.num_cached, offset))
                offset += seg.context_slots.numel()
            slots = torch.cat([seg.context_slots for seg in self.prefills]).to(torch.long)
            shared = None
            if self.prefill_sharing is not None:
                shared = torch.tensor(self.prefill_sharing, dtype=torch.long).view(-1, 2)
            self._kernel_args = (slots, torch.tensor(rows, dtype=torch.long).view(-1, 4), shared)
        return self._kernel_args

    def prefill_groups(self) -> tuple[list[FreshGroup], list[PrefillSegment]]:
        """Fresh prompts grouped for batched attention, and the segments left to run alone.
        Computed on the first layer's call and kept for the others."""
        if self._groups is None:
            groups: list[FreshGroup] = []
            alone: list[PrefillSegment] = []
            run: list[PrefillSegment] = []

            def close_run() -> None:
                if len(run) > 1:
                    slots = torch.cat([seg.context_slots for seg in run])
                    groups.append(FreshGroup(run[0].query_start, len(run), run[0].num_new, slots))
                else:
                    alone.extend(run)
                run.clear()

            for seg in self.prefills:
                joins = (
                    seg.num_cached == 0
                    and run
                    and seg.num_new == run[0].num_new
                    and seg.query_start == run[-1].query_start + run[-1].num_new
                )
                if not joins:
                    close_run()
                if seg.num_cached == 0:
                    run.append(seg)
                else:
                    alone.append(seg)
            close_run()
            self._groups = (groups, alone)
        return self._groups


    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of KV group `group` reads: this one (a pool without groups)."""
        return self


@dataclasses.dataclass
class GroupedMetadata:
    """A step's attention metadata per KV group (engine/kv_groups.py): each group's tables,
    slots and windowed rows index its own blocks, and a layer reads its group's
    (`for_group`). The step's rows are the same in every group. Counts of KV read are
    averaged over the layers (each group's weighed by its layers)."""

    groups: list[AttentionMetadata]
    layers_per_group: list[int]

    def for_group(self, group: int) -> AttentionMetadata:
        return self.groups[group]

    @property
    def prefills(self) -> list[PrefillSegment]:
        return self.groups[0].prefills

    @property
    def shared_prefix(self) -> "SharedPrefixTensors | None":
        return next((m.shared_prefix for m in self.groups if m.shared_prefix is not None), None)

    def _mean(self, counts: list[int]) -> int:
        return sum(n * c for n, c in zip(self.layers_per_group, counts)) // sum(self.layers_per_group)

    @property
    def kv_positions_read(self) -> int:
        return self._mean([m.kv_positions_read for m in self.groups])

    def kv_positions_read_with_sharing(self) -> int:
        return self._mean([m.kv_positions_read_with_sharing() for m in self.groups])


@dataclasses.dataclass(frozen=True)
class SharedPrefixTensors:
    """A step's shared-prefix plan with the tensors its decode attention reads, built once per
    step for all layers: for the CPU kernels, their plan (`for_kernels`, run in the fused
    decode step or layer by layer); for the reference path, every level's slots and members
    and the suffixes' slots and mask (`for_reference`)."""

    plan: SharedPrefixPlan
    kernel_plan: object | None = None  # ops.SharedPrefixDecodePlan: the suffixes' first positions, each level's members and blocks
    level_slots: tuple[torch.Tensor, ...] = ()  # per level: [end - start] long, its KV slots in order
    level_members: tuple[torch.Tensor, ...] = ()  # per level: [len(members)] long, its decode rows
    suffix_slots: torch.Tensor | None = None  # [B, max_suffix] long, padded with slot 0
    suffix_mask: torch.Tensor | None = None  # [B, 1, 1, max_suffix] bool (True = visible)

    @property
    def on_kernels(self) -> bool:
        return self.kernel_plan is not None

    @classmethod
    def for_kernels(cls, plan: SharedPrefixPlan, ops, device: torch.device) -> "SharedPrefixTensors":
        """The plan as ops.shared_prefix_decode_attention reads it (ops.SharedPrefixDecodePlan)."""
        levels = [
            ops.SharedPrefixLevel(members=torch.tensor(lv.members, dtype=torch.long, device=device),
                             blocks=torch.tensor(lv.block_ids, dtype=torch.int32, device=device), num_positions=lv.num_positions)
            for lv in plan.levels
        ]  # fmt: skip
        suffix_start = torch.tensor(plan.suffix_start, dtype=torch.int32, device=device)
        return cls(plan, kernel_plan=ops.SharedPrefixDecodePlan(suffix_start=suffix_start, levels=levels))

    @classmethod
    def for_reference(cls, plan: SharedPrefixPlan, block_tables: list[list[int]], device: torch.device) -> "SharedPrefixTensors":
        """Every level's slots and members, and the suffixes batched: their slots and visibility."""
        bs = plan.block_size
        offsets = torch.arange(bs)
        level_slots = tuple(
            (torch.tensor(level.block_ids, dtype=torch.long).unsqueeze(1) * bs + offsets).reshape(-1).to(device)
            for level in plan.levels
        )
        level_members = tuple(torch.tensor(level.members, dtype=torch.long, device=device) for level in plan.levels)
        lengths = [n - s for n, s in zip(plan.context_lens, plan.suffix_start)]
        width = max(lengths)  # >= 1: the new position is always its request's own
        rows = []
        for table, start, n in zip(block_tables, plan.suffix_start, plan.context_lens):
            slots = context_slots(table, n, bs)[start:]
            rows.append(torch.cat([slots, slots.new_zeros(width - len(slots))]))
        mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return cls(
            plan, level_slots=level_slots, level_members=level_members, suffix_slots=torch.stack(rows).to(device),
            suffix_mask=mask.view(len(rows), 1, 1, width).to(device),
        )


def context_slots(block_table: list[int], num_positions: int, block_size: int) -> torch.Tensor:
    """Physical slots of logical positions [0, num_positions): block_table[p // bs] * bs + p % bs."""
    positions = torch.arange(num_positions)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def rectangular_causal_mask(num_cached: int, num_new: int) -> torch.Tensor:
    """[m, S0 + m]: history fully visible; in the new block only the strictly upper triangle is hidden."""
    cols = torch.arange(num_cached + num_new)
    rows = torch.arange(num_new).unsqueeze(1)
    return cols <= rows + num_cached


def rectangular_causal_bias(num_cached: int, num_new: int, dtype: torch.dtype) -> torch.Tensor:
    """The same mask as an additive bias: 0 where visible, -inf where hidden."""
    visible = rectangular_causal_mask(num_cached, num_new)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
