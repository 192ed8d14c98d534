"""KV groups: how the pool holds a model whose layers attend differently (seed §3: capacity is
what a request keeps, not what it has seen).

A sliding-window layer needs only the last W positions of a request; a global layer needs
all of them. With one block table per request, a block holds one span of positions for every
layer, so the window could free nothing. Here the layers are cut into groups of one kind each
(global, or one window), every group `layers_per_block` layers wide, and each group has its
own block table per request; all groups draw their blocks from one pool. A block is one span
of `block_size` positions for `layers_per_block` layers (one layer slot of the pool each), so
memory moves freely between kinds: a sliding group's blocks that fall out of the window go
back to the pool as the request proceeds, and a global group's blocks take them.

The group width is chosen for little waste (a kind whose layer count is not a multiple of
the width leaves slots of its last group empty) with as few groups as that allows (each group
is one more table and one more set of attention metadata per step): the widest width whose
empty slots are at most a tenth of the layers. A model whose layers are all alike is one
group as wide as the model: one table, exactly the layout without groups. Torch-free: the
simulator and the planner count with it.

A sliding group's table keeps an entry for every block of the request; the entries of blocks
freed out of the window point at block 0, which such a pool reserves and never hands out
(no kernel reads them: a row past the window reads only its window, attention/sliding_window.py).
"""

from __future__ import annotations

import dataclasses

NULL_BLOCK = 0  # a grouped pool's placeholder for a freed table entry
_MAX_EMPTY_SLOTS = 0.1  # of the layers


@dataclasses.dataclass(frozen=True)
class KVGroups:
    layers_per_block: int  # U: layer slots of one block
    group_windows: tuple[int | None, ...]  # per group: its layers' window, None for global
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in the group's blocks

    @classmethod
    def single(cls, num_layers: int) -> "KVGroups":
        """Every layer in one group: one table per request, each block holding every layer."""
        return cls(num_layers, (None,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def for_windows(cls, windows: tuple[int | None, ...]) -> "KVGroups":
        """Groups for layers with these windows (None: global); one group if they are all alike."""
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # global first
        if len(kinds) == 1:
            return cls(len(windows), (kinds[0],), (0,) * len(windows), tuple(range(len(windows))))
        counts = [sum(1 for w in windows if w == k) for k in kinds]
        width = max(u for u in range(1, max(counts) + 1)
                    if sum(-(-n // u) * u for n in counts) - len(windows) <= _MAX_EMPTY_SLOTS * len(windows))  # fmt: skip
        group_windows: list[int | None] = []
        first_group = {}
        for kind, n in zip(kinds, counts):
            first_group[kind] = len(group_windows)
            group_windows += [kind] * -(-n // width)
        layer_group, layer_slot, seen = [], [], {k: 0 for k in kinds}
        for w in windows:
            i = seen[w]
            seen[w] += 1
            layer_group.append(first_group[w] + i // width)
            layer_slot.append(i % width)
        return cls(width, tuple(group_windows), tuple(layer_group), tuple(layer_slot))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def grouped(self) -> bool:
        """More than one group: a table per group."""
        return self.num_groups > 1

    @property
    def windowed(self) -> bool:
        """Some group drops the blocks its window has left behind."""
        return any(w is not None for w in self.group_windows)

    @property
    def reserved_blocks(self) -> int:
        """Block 0, the placeholder of dropped entries, where a table can have them."""
        return 1 if self.windowed else 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def empty_slots(self) -> int:
        """Layer slots of the groups' blocks that hold no layer."""
        return self.num_groups * self.layers_per_block - self.num_layers

    def blocks_held(self, num_positions: int, block_size: int) -> int:
        """Blocks a request decoding holds once its `num_positions` positions are computed: all
        of a global group's, a sliding group's from the block of the first position its last
        query saw (n - W) to the last."""
        if num_positions <= 0:
            return 0
        total = -(-num_positions // block_size)
        held = 0
        for window in self.group_windows:
            first = 0 if window is None else max(0, num_positions - window) // block_size
            held += total - first
        return held

    def peak_blocks(self, num_positions: int, block_size: int, chunk: int) -> int:
        """The most blocks a request of `num_positions` holds at once, its positions computed
        at most `chunk` a step: a sliding group holds, in the step computing positions
        [s, s + m), the blocks from (s - W + 1)'s to the last, W - 1 + m positions at most."""
        total = -(-num_positions // block_size)
        held = 0
        for window in self.group_windows:
            span = total if window is None else min(total, -(-(window - 1 + chunk) // block_size) + 1)
            held += span
        return held

    def max_request_positions(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """The longest request a pool of `num_blocks` holds alone (its reserved block aside),
        its positions computed at most `chunk` a step (`peak_blocks`); unbounded (2^40) where
        every group slides."""
        usable = num_blocks - self.reserved_blocks
        lo, hi = 0, 1 << 40
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(mid, block_size, chunk) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def positions_held(self, num_positions: int) -> int:
        """Positions of KV (per layer, summed over the layers) a request of `num_positions`
        keeps at the least: every layer's, a windowed layer's last W. The pool holds them in
        whole blocks (`blocks_held`)."""
        return sum(num_positions if self.group_windows[g] is None else min(num_positions, self.group_windows[g])
                   for g in self.layer_group)  # fmt: skip

    def describe(self) -> str:
        kinds = {}
        for g, w in enumerate(self.group_windows):
            kinds.setdefault(w, []).append(g)
        parts = [f"{len(gs)} {'global' if w is None else f'window-{w}'} group{'s' if len(gs) > 1 else ''}"
                 for w, gs in kinds.items()]  # fmt: skip
        empty = f", {self.empty_slots} empty slot{'s' if self.empty_slots != 1 else ''}" if self.empty_slots else ""
        return f"{', '.join(parts)} of {self.layers_per_block} layers{empty}"
