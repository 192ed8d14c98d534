"""Shared-prefix ("cascade") decode attention: a prefix stored once is also read once.

The prefix cache shares full KV blocks physically between requests with the same token
prefix (engine/block_pool.py: a block's hash chains over every token before it, so the
same physical block id at table index i means the same prefix up to block i). A decode
kernel that scans each request's history alone still reads a shared prefix once per
request (the seed's §3: 1.25 GiB stored, 3.75 GiB read per step). Here the batch's
decode rows are grouped by the block ids their tables start with, and attention runs in
parts:

- per group level, all member queries against the shared positions at once (non-causal:
  every shared position is in every member's history), the shared K/V gathered once;
- per request, its own suffix (the positions after its deepest level, the new one included);
- the parts merged in fp32 through their log-sum-exp (`merge_attention_states`).

Levels nest: 16 requests sharing a system prompt of 8 blocks, 4 of which also share the
next 20 blocks, give a level [0, 8·b) of 16 members and a level [8·b, 28·b) of 4; each
request's parts are its levels (disjoint, consecutive position ranges from 0) and its
suffix [end of deepest level, context_len).

`find_shared_prefix_groups` builds the plan (a radix walk over the tables, O(total
blocks)); `cascade_decode_attention` is the plain-torch reference computation the C++
kernels are tested against; `SharedPrefixRule` says when a plan is worth using.

Prompt chunks whose history is a shared cached prefix (several new prompts hitting the same
system prompt in one step) need no parts: every chunk's queries see all of the prefix, so
`find_shared_prefill_prefixes` only names, per chunk, the leader whose K/V it reads for the
shared positions, and the prefill paths read them once (attention/paged.py,
kernels/prefill_attention.cpp) with the same result as reading them per chunk.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class SharedLevel:
    """One group's shared part: positions [start, end) of every member, block-aligned."""

    group_id: int  # index in CascadePlan.levels
    start: int  # first position
    end: int  # end position (exclusive)
    members: list[int]  # decode rows (indices into the decode batch), ascending
    block_ids: list[int]  # the physical blocks of [start, end), the same in every member's table
    parent: int | None  # the group id of the level just above (None: starts at position 0)
    slots: torch.Tensor | None = None  # [end - start] long, the KV slots in order (on the model's device)
    member_index: torch.Tensor | None = None  # [len(members)] long, on the model's device

    @property
    def num_positions(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class CascadePlan:
    """The decode batch's shared-prefix structure for one step (shared by all layers).

    `request_levels[r]`: row r's levels as (group id, first position, end position), outer
    first; disjoint and consecutive from 0. `suffix_start[r]`: the end of its deepest level
    (0 without one); its own part is [suffix_start[r], context_lens[r]).
    """

    block_size: int
    levels: list[SharedLevel]
    request_levels: list[list[tuple[int, int, int]]]
    suffix_start: list[int]
    context_lens: list[int]
    # the suffix part, batched: [B, max_suffix] slots (padded with slot 0) and [B, 1, 1, max_suffix] visibility
    suffix_slots: torch.Tensor | None = None
    suffix_mask: torch.Tensor | None = None
    # set by the attention path that computed with it; False where a path ignored the plan
    # (fp32 on the kernel path), and then the step read every history in full
    applied: bool = False
    # the CPU kernels' input (`build_kernel_tensors`): ops.DecodeCascade, the suffixes' first
    # positions and each level's members and blocks; set: the kernel path runs the plan, in
    # the fused decode step or layer by layer
    kernel_plan: object | None = None

    @property
    def uses_kernels(self) -> bool:
        return self.kernel_plan is not None

    @property
    def num_decodes(self) -> int:
        return len(self.context_lens)

    def positions_read_per_request(self) -> int:
        """Σ_r context_len_r: what a per-request scan reads (positions, all layers' K and V)."""
        return sum(self.context_lens)

    def positions_read_once(self) -> int:
        """Each level once per group, plus every request's suffix."""
        shared = sum(level.num_positions for level in self.levels)
        private = sum(n - s for n, s in zip(self.context_lens, self.suffix_start))
        return shared + private

    def describe(self) -> str:
        return "; ".join(
            f"group {lv.group_id}: {len(lv.members)} rows x [{lv.start}, {lv.end})" for lv in self.levels
        ) or "no groups"

    def to(self, device: torch.device) -> "CascadePlan":
        """Build the tensors the reference path reads (slots of every level, the suffixes' slots and mask)."""
        bs = self.block_size
        offsets = torch.arange(bs)
        for level in self.levels:
            blocks = torch.tensor(level.block_ids, dtype=torch.long)
            level.slots = (blocks.unsqueeze(1) * bs + offsets).reshape(-1).to(device)
            level.member_index = torch.tensor(level.members, dtype=torch.long, device=device)
        return self

    def build_kernel_tensors(self, ops, device: torch.device) -> "CascadePlan":
        """The plan as ops.cascade_decode_attention reads it (ops.DecodeCascade), made once per
        step for all layers."""
        levels = []
        for level in self.levels:
            level.member_index = torch.tensor(level.members, dtype=torch.long, device=device)
            blocks = torch.tensor(level.block_ids, dtype=torch.int32, device=device)
            levels.append(ops.CascadeLevel(members=level.member_index, blocks=blocks, num_positions=level.num_positions))
        suffix_start = torch.tensor(self.suffix_start, dtype=torch.int32, device=device)
        self.kernel_plan = ops.DecodeCascade(suffix_start=suffix_start, levels=levels)
        return self

    def build_suffix_tensors(self, block_tables: list[list[int]], device: torch.device) -> None:
        bs = self.block_size
        lengths = [n - s for n, s in zip(self.context_lens, self.suffix_start)]
        width = max(lengths)  # >= 1: the new position is always its request's own
        rows = []
        for table, start, n in zip(block_tables, self.suffix_start, self.context_lens):
            pos = torch.arange(start, n)
            blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
            slots = blocks * bs + pos % bs
            rows.append(torch.cat([slots, slots.new_zeros(width - len(slots))]))
        self.suffix_slots = torch.stack(rows).to(device)
        lens = torch.tensor(lengths)
        self.suffix_mask = (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).view(len(rows), 1, 1, width).to(device)


def shareable_blocks(context_len: int, block_size: int) -> int:
    """Full blocks all of whose positions are < context_len - 1: the history only, never the
    block the new position is written into this step."""
    return max(context_len - 1, 0) // block_size


def find_shared_prefix_groups(
    block_tables: list[list[int]], context_lens: list[int], block_size: int,
    min_shared_blocks: int = 1, min_group_size: int = 2,
) -> CascadePlan:
    """Group the decode rows by the physical block ids their tables start with.

    A radix walk: at block index d the rows still together are split by their block id at
    d; each split of at least `min_group_size` rows then extends while every member has the
    same block at the next index (and that block is still shareable for all of them). Each
    such node covers blocks [d, d'); it becomes a level if it has at least
    `min_shared_blocks` blocks counting from the end of its members' last level (a node too
    short to stand alone hands its blocks down to the levels below it). Every row is touched
    once per block it shares: O(Σ blocks) per step.
    """
    n_rows = len(block_tables)
    limit = [min(shareable_blocks(n, block_size), len(t)) for n, t in zip(context_lens, block_tables)]
    levels: list[SharedLevel] = []
    request_levels: list[list[tuple[int, int, int]]] = [[] for _ in range(n_rows)]
    deepest = [0] * n_rows  # block index where each row's own part starts
    min_group_size = max(min_group_size, 2)
    min_shared_blocks = max(min_shared_blocks, 1)

    # stack of (rows that share blocks [0, depth), depth, pending: first block not yet in a level, parent level)
    stack: list[tuple[list[int], int, int, int | None]] = [(list(range(n_rows)), 0, 0, None)]
    while stack:
        rows, depth, pending, parent = stack.pop()
        splits: dict[int, list[int]] = {}
        for r in rows:
            if limit[r] > depth:
                splits.setdefault(block_tables[r][depth], []).append(r)
        # visit the splits in the order of their first row (the plan is deterministic)
        children = []
        for members in splits.values():
            if len(members) < min_group_size:
                continue
            end = depth + 1
            first = block_tables[members[0]]
            while all(limit[r] > end for r in members) and all(block_tables[r][end] == first[end] for r in members):
                end += 1
            child_pending, child_parent = pending, parent
            if end - pending >= min_shared_blocks:
                gid = len(levels)
                levels.append(SharedLevel(gid, pending * block_size, end * block_size, members, first[pending:end], parent))
                for r in members:
                    request_levels[r].append((gid, pending * block_size, end * block_size))
                    deepest[r] = end
                child_pending, child_parent = end, gid
            children.append((members, end, child_pending, child_parent))
        stack.extend(reversed(children))
    return CascadePlan(
        block_size=block_size,
        levels=levels,
        request_levels=request_levels,
        suffix_start=[d * block_size for d in deepest],
        context_lens=list(context_lens),
    )


@dataclasses.dataclass(frozen=True)
class SharedPrefixRule:
    """When a step's decode batch runs in parts. For now any group of >= 2 rows sharing
    >= 1 block; the thresholds are where measured crossovers (prefix length, group size)
    will go."""

    min_shared_blocks: int = 1
    min_group_size: int = 2

    def plan(self, block_tables: list[list[int]], context_lens: list[int], block_size: int) -> CascadePlan | None:
        if len(block_tables) < self.min_group_size or not _any_first_block_shared(block_tables, context_lens, block_size):
            return None
        plan = find_shared_prefix_groups(block_tables, context_lens, block_size, self.min_shared_blocks, self.min_group_size)
        return plan if plan.levels else None


def _any_first_block_shared(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> bool:
    """O(B) early out: no two rows with the same first shareable block means no group."""
    seen: set[int] = set()
    for table, n in zip(block_tables, context_lens):
        if shareable_blocks(n, block_size) and table:
            if table[0] in seen:
                return True
            seen.add(table[0])
    return False


# ---- prefill chunks over a shared cached prefix ---------------------------------------------

# A shared prefix of prefill segments is cut to a multiple of this many positions: the prefill
# kernel's packed K tiles come in groups of 4 blocks of 16 keys and its V tiles in pairs of 32
# keys, so a member can read the leader's tiles up to there and its own after, in one pass.
PREFILL_SHARE_MULTIPLE = 64


def find_shared_prefill_prefixes(
    block_tables: list[list[int]], num_cached: list[int], block_size: int, min_group_size: int = 2,
) -> list[tuple[int, int]] | None:
    """For prefill segments (several new prompts that hit the same cached system prompt in
    one step): per segment (leader, shared_len). A group's members share the leader's cached
    positions [0, shared_len) (the outermost level of `find_shared_prefix_groups` over the
    cached part, cut to PREFILL_SHARE_MULTIPLE); the leader (its first member) and segments in
    no group have (itself, 0). Every member's queries see all of the shared part (it lies
    before each chunk), so attention reads it once for the group and the result is the same,
    bit for bit, as reading it per segment. None when no group forms."""
    if len(block_tables) < max(min_group_size, 2):
        return None
    plan = find_shared_prefix_groups(
        block_tables, [n + 1 for n in num_cached], block_size, -(-PREFILL_SHARE_MULTIPLE // block_size), min_group_size
    )
    sharing = [(i, 0) for i in range(len(block_tables))]
    found = False
    for level in plan.levels:
        length = level.end // PREFILL_SHARE_MULTIPLE * PREFILL_SHARE_MULTIPLE
        if level.parent is not None or length == 0:
            continue
        leader = level.members[0]
        for r in level.members[1:]:
            sharing[r] = (leader, length)
        found = True
    return sharing if found else None


def prefill_positions_read_once(sharing: list[tuple[int, int]] | None) -> int:
    """Positions a step's prefill attention no longer reads with `sharing`: each member's shared part."""
    return sum(length for _, length in sharing) if sharing else 0


# ---- the math: attention parts with their log-sum-exp, and the merge ---------------------


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [..., M, H] over k, v [..., S, H], computed explicitly in fp32:
    scores, their log-sum-exp, softmax @ V. `mask` (bool, True = visible) broadcasts to
    [..., M, S]. Returns (out [..., M, H] fp32, lse [..., M] fp32); a row that sees nothing
    (S = 0 or all masked) has out 0 and lse -inf, the merge's identity."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if scores.shape[-1] == 0:  # logsumexp of nothing is -inf already; keep the shapes
        return scores.new_zeros((*scores.shape[:-1], v.shape[-1])), lse
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe.unsqueeze(-1))  # exp(-inf) = 0 in a row that sees nothing
    return torch.matmul(probs, v.float()), lse


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two parts of one softmax over disjoint keys → the whole: lse = log(e^a + e^b), out =
    (e^(a - lse)·out_a + e^(b - lse)·out_b), in fp32. out [..., H], lse [...]. An empty part
    (lse = -inf) contributes nothing; both empty gives out 0, lse -inf."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    lse = top + torch.log(total)  # log 0 = -inf where both are empty
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a.float() * (wa / denom).unsqueeze(-1)) + (out_b.float() * (wb / denom).unsqueeze(-1))
    return out, lse


# ---- the reference path -------------------------------------------------------------------


def cascade_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CascadePlan, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, N_q, H], one new position per decode row → [B, N_q, H] in q's dtype.

    Each level's shared K/V is gathered once (dequantized for int8 pools) and all its
    members' queries attend to it in one product: [N_kv, n·g, H] x [N_kv, H, S]. The
    suffixes run batched with a padding mask. Parts are merged through their lse.
    """
    from kvserve.attention.paged import gather  # paged imports this module for its hook

    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[-2]
    g = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, g, head_dim)
    # the suffixes, every row: [B, N_kv, g, H] and lse [B, N_kv, g]
    k = gather(k_pool, plan.suffix_slots, k_scale, q.dtype).permute(0, 2, 1, 3)  # [B, N_kv, Ls, H]
    v = gather(v_pool, plan.suffix_slots, v_scale, q.dtype).permute(0, 2, 1, 3)
    acc_out, acc_lse = attention_with_lse(qg, k, v, scale, plan.suffix_mask)
    for level in plan.levels:
        idx = level.member_index
        n = idx.numel()
        ks = gather(k_pool, level.slots, k_scale, q.dtype).transpose(0, 1)  # [N_kv, S, H], read once for n rows
        vs = gather(v_pool, level.slots, v_scale, q.dtype).transpose(0, 1)
        qs = qg.index_select(0, idx).permute(1, 0, 2, 3).reshape(num_kv_heads, n * g, head_dim)
        o, lse = attention_with_lse(qs, ks, vs, scale)  # non-causal: all shared positions visible
        o = o.view(num_kv_heads, n, g, head_dim).permute(1, 0, 2, 3)
        lse = lse.view(num_kv_heads, n, g).permute(1, 0, 2)
        merged, merged_lse = merge_attention_states(acc_out.index_select(0, idx), acc_lse.index_select(0, idx), o, lse)
        acc_out.index_copy_(0, idx, merged)
        acc_lse.index_copy_(0, idx, merged_lse)
    plan.applied = True
    return acc_out.to(q.dtype).reshape(batch, num_heads, head_dim)


def cascade_decode_attention_kernels(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CascadePlan, scale: float, ops,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same parts as `cascade_decode_attention`, on the CPU kernels (bf16 queries; bf16
    pools, or int8 ones with their scales), in one call (ops.cascade_decode_attention, the
    function the fused decode step runs per layer): every row's suffix (`paged_decode_attention_lse` from its suffix start), then each level's
    members against the level's blocks (`shared_prefix_attention`: each block read once for
    all of them), merged in fp32 in the same order as the reference: suffix, then levels outer
    to inner. q: [B, N_q, H] → [B, N_q, H] in q's dtype."""
    out = ops.cascade_decode_attention(q, k_pool, v_pool, block_tables, context_lens, plan.kernel_plan, scale, k_scale, v_scale)
    plan.applied = True
    return out
