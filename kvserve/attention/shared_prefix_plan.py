"""Shared-prefix attention's plan: which rows read which shared prefix once, and what that saves.

The prefix cache shares full KV blocks physically between requests with the same token
prefix (engine/prefix_cache.py: a block's hash chains over every token before it, so the
same physical block id at table index i means the same prefix up to block i). A decode
kernel that scans each request's history alone still reads a shared prefix once per
request (the seed's §3: 1.25 GiB stored, 3.75 GiB read per step). Here the batch's decode
rows are grouped by the block ids their tables start with, and attention runs in parts:

- per group level, all member queries against the shared positions at once (non-causal:
  every shared position is in every member's history), the shared K/V read once;
- per request, its own suffix (the positions after its deepest level, the new one included);
- the parts merged in fp32 through their log-sum-exp (attention/merge.py).

Levels nest: 16 requests sharing a system prompt of 8 blocks, 4 of which also share the
next 20 blocks, give a level [0, 8·b) of 16 members and a level [8·b, 28·b) of 4; each
request's parts are its levels (disjoint, consecutive position ranges from 0) and its
suffix [end of deepest level, context_len).

Prompt chunks whose history is a shared cached prefix (several new prompts hitting the same
system prompt in one step) need no parts: every chunk's queries see all of the prefix, so
`find_shared_prefill_prefixes` only names, per chunk, the leader whose K/V it reads for the
shared positions, with the same result as reading them per chunk.

Plain Python (no torch), so the simulator (engine/step_shape.py) groups and counts a step by
the engine's own rule; attention/metadata.py SharedPrefixTensors turns a plan into what the
reference path or the CPU kernels read.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SharedLevel:
    """One group's shared part: positions [start, end) of every member, block-aligned."""

    group_id: int  # index in SharedPrefixPlan.levels
    start: int  # first position
    end: int  # end position (exclusive)
    members: list[int]  # decode rows (indices into the decode batch), ascending
    block_ids: list[int]  # the physical blocks of [start, end), the same in every member's table
    parent: int | None  # the group id of the level just above (None: starts at position 0)

    @property
    def num_positions(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class SharedPrefixPlan:
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

    def positions_read_per_request(self) -> int:
        """Σ_r context_len_r: what a per-request scan reads (positions, all layers' K and V)."""
        return sum(self.context_lens)

    def positions_read_once(self) -> int:
        """Each level once per group, plus every request's suffix."""
        shared = sum(level.num_positions for level in self.levels)
        private = sum(n - s for n, s in zip(self.context_lens, self.suffix_start))
        return shared + private


def shareable_blocks(context_len: int, block_size: int) -> int:
    """Full blocks all of whose positions are < context_len - 1: the history only, never the
    block the new position is written into this step."""
    return max(context_len - 1, 0) // block_size


def find_shared_prefix_groups(
    block_tables: list[list[int]], context_lens: list[int], block_size: int,
    min_shared_blocks: int = 1, min_group_size: int = 2,
) -> SharedPrefixPlan:
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
    return SharedPrefixPlan(
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

    def plan(self, block_tables: list[list[int]], context_lens: list[int], block_size: int) -> SharedPrefixPlan | None:
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


# ---- what a step reads ----------------------------------------------------------------------


def kv_positions_read(
    per_request: int, decode_plan: SharedPrefixPlan | None = None, prefill_sharing: list[tuple[int, int]] | None = None,
) -> int:
    """KV positions (all layers' K and V, c_kv each) a step's attention reads, the one count
    the engine's counters (attention/metadata.py) and the simulator (engine/step_shape.py) use.
    `per_request`: what scanning every request's history alone reads (Σ decode context
    lengths + Σ prompt chunks' S0 + m). With a decode plan its decode rows read each shared
    level once per group and their suffixes; with prefill sharing each member's shared part
    is read by its leader only."""
    read = per_request - prefill_positions_read_once(prefill_sharing)
    if decode_plan is None:
        return read
    return read - decode_plan.positions_read_per_request() + decode_plan.positions_read_once()
