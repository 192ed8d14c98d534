"""A same-host AllReduce through shared memory, beside gloo's.

gloo over loopback costs about 0.3 ms per collective on this machine (`kvserve plan
calibrate`), and a SmolLM2 decode step makes 60 of them. On one host the ranks can instead
each write their partial sum into a shared segment, wait until every rank has written, and
each add the N slots itself. Two copies of memory and no sockets; vLLM's CPU backend does the
same for the same reason.

Protocol, per collective k (a counter every rank advances in step):
- buffer k % 2 holds one slot per rank; rank r writes its slot, then publishes k in flag[r];
- it waits until every flag is >= k, then sums the slots in rank order (the same order on
  every rank, so every rank gets the same bits, whatever the timing);
- double buffering makes that safe to repeat: a rank writing collective k + 2 into the buffer
  of k has seen every flag >= k + 1, so every rank has finished reading collective k.

The protocol rests on x86's ordered stores (a rank that sees flag k also sees the slot
written before it). numpy's stores carry no fence, so on a weakly ordered CPU (ARM) a rank
could read a slot before its data lands: there the AllReduce stays on gloo
(`stores_ordered()`).

Waiting spins briefly, then yields the core (sleep(0)), then sleeps 50 µs at a time, so a
rank that shares a core with others does not starve them. Messages larger than a slot go to
gloo.

The requests KV layout's all-to-all uses the same segment and counter: each rank writes how
many bytes it sends each rank (a header of N int64) and then those parts back to back into
its slot; after the wait, each rank copies its part out of every slot, in rank order.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import numpy as np
import torch

def stores_ordered() -> bool:
    """Whether this CPU keeps stores in program order for other cores (x86's TSO), which the
    flag-after-data protocol needs."""
    from kvserve.kernels.isa import machine_arch

    return machine_arch() == "x86_64"


_SPINS = 2000  # polls before yielding the core
_YIELDS = 2000  # sleep(0) polls before sleeping
_FLAG_BYTES = 64  # one cache line per rank's flag
# ReduceScatter + AllGather instead of the one-shot sum: one more wait, but each rank reads
# 2·n elements rather than N·n. At two ranks both read 2·n, so the one shot is never worse
# (measured, AMD Zen 4: two-shot 0.65-1.02x the one shot's speed, 2 KB to 4 MB). Among 3 or
# more ranks it saves (N-2)·n reads for one more wait: that wait cost 10-40 µs with a core
# per rank, so from 64 Ki fp32 elements ((N-2)·256 KB, about 25 µs at 10 GB/s) on. With
# more ranks than cores the second wait lands on a descheduled rank (1.5-3 ms measured, 3
# ranks on 2 cores), so then never. `python -m kvserve.planner.collectives --ranks N
# --compare two-shot` measures it.
TWO_SHOT_MIN_RANKS = 3
TWO_SHOT_MIN_ELEMENTS = 1 << 16


def two_shot_pays(world: int) -> bool:
    """3+ ranks, and a core for each of them (this process's affinity: the host's cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return world >= TWO_SHOT_MIN_RANKS and cores >= world


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmAllReduce:
    """One shared segment for the ranks of this host; `all_reduce` sums fp32 tensors of up to
    `max_elements` elements in place. The segment is a file mapped by every rank (torch.from_file);
    rank 0 removes its name once all have mapped it (`unlink`), so nothing is left behind
    whatever way the ranks end."""

    def __init__(self, path: str | None, rank: int, world: int, max_elements: int, timeout_s: float):
        self.rank, self.world, self.max_elements, self.timeout_s = rank, world, max_elements, timeout_s
        floats = world * _FLAG_BYTES // 4 + 2 * world * max_elements
        if path is None:  # rank 0 creates it; the others map it by its path
            path = os.path.join(_shm_dir(), f"kvserve-allreduce-{uuid.uuid4().hex}")
            with open(path, "wb") as f:
                f.truncate(floats * 4)  # zeros: every flag starts at 0
        self.path = path
        self.buffer = torch.from_file(path, shared=True, size=floats, dtype=torch.float32)
        raw = self.buffer.numpy()
        self.flags = raw[: world * _FLAG_BYTES // 4].view(np.int64).reshape(world, _FLAG_BYTES // 8)
        self.slots = raw[world * _FLAG_BYTES // 4 :].reshape(2, world, max_elements)
        self.count = 0
        # large messages in two shots (rank 0's verdict, `two_shot_pays`, sent to all: every
        # rank must make the same number of waits)
        self.two_shot = False

    def unlink(self) -> None:
        """Rank 0, once every rank has mapped the segment: its name goes, the mappings stay."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.is_contiguous() and x.numel() <= self.max_elements and x.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor, two_shot: bool | None = None) -> torch.Tensor:
        """Σ over the ranks of fp32 `x`, in place, summed in rank order on every rank.
        `two_shot` (default: among 3+ ranks with a core each, from TWO_SHOT_MIN_ELEMENTS): as a
        ReduceScatter then an AllGather, the same bits."""
        if two_shot is None:
            two_shot = self.two_shot and x.numel() >= TWO_SHOT_MIN_ELEMENTS
        if two_shot:
            return self._reduce_scatter_all_gather(x)
        self.count += 1
        k, n = self.count, x.numel()
        slots = self.slots[k % 2]
        mine = x.view(-1).numpy()
        slots[self.rank, :n] = mine
        self.flags[self.rank, 0] = k  # published after the data (x86 keeps the stores in order)
        self._wait_for(k)
        np.copyto(mine, slots[0, :n])
        for r in range(1, self.world):
            mine += slots[r, :n]
        return x

    def _reduce_scatter_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The same sum in two collectives: each rank adds up its 1/N of the elements from
        every slot (ReduceScatter), writes that part into its slot of the other buffer, and
        copies every rank's part out (AllGather). A rank reads 2·n elements instead of N·n;
        every element is still summed in rank order, so the bits equal the one-shot sum's."""
        self.count += 1
        k, n = self.count, x.numel()
        slots = self.slots[k % 2]
        mine = x.view(-1).numpy()
        slots[self.rank, :n] = mine
        self.flags[self.rank, 0] = k
        self._wait_for(k)
        bounds = [n * r // self.world for r in range(self.world + 1)]
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        part = slots[0, lo:hi].copy()
        for r in range(1, self.world):
            part += slots[r, lo:hi]
        # the other buffer is free: every rank published k, so all finished reading k - 1
        self.count += 1
        k = self.count
        gathered = self.slots[k % 2]
        gathered[self.rank, lo:hi] = part
        self.flags[self.rank, 0] = k
        self._wait_for(k)
        for r in range(self.world):
            mine[bounds[r] : bounds[r + 1]] = gathered[r, bounds[r] : bounds[r + 1]]
        return x

    def fits_all_to_all(self, largest_send: int, element_size: int) -> bool:
        """Whether the largest part any rank sends (elements) fits a slot beside the header.
        Every rank must decide alike, so the caller passes the largest of all ranks' sends."""
        return 8 * self.world + largest_send * element_size <= 4 * self.max_elements

    def all_to_all(self, x: torch.Tensor, in_splits: list[int], out: torch.Tensor, out_splits: list[int]) -> torch.Tensor:
        """x (1-D, contiguous CPU) cut into `in_splits` elements per destination; `out` gets
        `out_splits` elements from each source, in rank order. Any dtype: bytes are moved."""
        self.count += 1
        k, esize = self.count, x.element_size()
        slot_bytes = self.slots[k % 2].view(np.uint8)  # [world, 4 * max_elements]
        header = slot_bytes[self.rank, : 8 * self.world].view(np.int64)
        header[:] = [n * esize for n in in_splits]
        data = x.view(torch.uint8).numpy() if x.numel() else np.empty(0, np.uint8)
        slot_bytes[self.rank, 8 * self.world : 8 * self.world + data.size] = data
        self.flags[self.rank, 0] = k  # published after the data (x86 keeps the stores in order)
        self._wait_for(k)
        got = out.view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
        at = 0
        for r in range(self.world):
            sizes = slot_bytes[r, : 8 * self.world].view(np.int64)
            start = 8 * self.world + int(sizes[: self.rank].sum())
            n = out_splits[r] * esize
            if int(sizes[self.rank]) != n:
                raise RuntimeError(f"shared-memory all-to-all: rank {r} sends {int(sizes[self.rank])} bytes, {n} expected")
            got[at : at + n] = slot_bytes[r, start : start + n]
            at += n
        return out

    def _wait_for(self, k: int) -> None:
        flags = self.flags[:, 0]
        polls, deadline = 0, None
        while int(flags.min()) < k:
            polls += 1
            if polls < _SPINS:
                continue
            if polls < _SPINS + _YIELDS:
                time.sleep(0)
                continue
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                late = [r for r in range(self.world) if int(flags[r]) < k]
                raise TimeoutError(f"shared-memory AllReduce: rank(s) {late} did not arrive within {self.timeout_s:.0f} s")
            time.sleep(50e-6)

    def close(self) -> None:
        self.flags = self.slots = self.buffer = None
        if self.rank == 0:
            self.unlink()
