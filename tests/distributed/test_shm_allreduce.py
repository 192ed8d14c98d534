"""The same-host shared-memory AllReduce (distributed/shm_allreduce.py): the ranks here are
threads of one process mapping the same segment, which the protocol does not distinguish
from processes. Sums in rank order (every rank the same bits), many collectives in a row
(the double buffering), a rank that never arrives named in the error; the all-to-all of
the requests KV layout on the same segment."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvserve.distributed.shm_allreduce import ShmAllReduce


def _run(world, fn):
    first = ShmAllReduce(None, 0, world, 4096, timeout_s=5)
    ranks = [first] + [ShmAllReduce(first.path, r, world, 4096, timeout_s=5) for r in range(1, world)]
    first.unlink()
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(ranks[r], r)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for shm in ranks:
        shm.close()
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_the_rank_ordered_sum_bit_for_bit(world):
    g = torch.Generator().manual_seed(0)
    parts = [[torch.randn(n, generator=g) for n in (1, 576, 4096, 7, 576)] for _ in range(world)]

    def fn(shm, r):
        return [shm.all_reduce(p.clone()) for p in parts[r]]

    results = _run(world, fn)
    for k in range(len(parts[0])):
        expected = parts[0][k].clone()
        for r in range(1, world):
            expected += parts[r][k]
        for r in range(world):
            assert torch.equal(results[r][k], expected)


def test_a_rank_that_never_arrives_is_named():
    first = ShmAllReduce(None, 0, 2, 16, timeout_s=0.3)
    other = ShmAllReduce(first.path, 1, 2, 16, timeout_s=0.3)  # maps it, never reduces
    first.unlink()
    assert not os.path.exists(first.path)  # the name is gone, the mappings stay
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not arrive"):
        first.all_reduce(torch.ones(4))
    first.close()
    other.close()


@pytest.mark.parametrize("world, dtype", [(2, torch.bfloat16), (3, torch.float32), (4, torch.bfloat16)])
def test_all_to_all_moves_each_part_to_its_rank(world, dtype):
    """Uneven parts, empty ones included, bf16 and fp32, between AllReduces on the same
    counter: rank d gets, from each rank s in order, the part s cut for d."""
    g = torch.Generator().manual_seed(1)
    sizes = [[(3 * s + 5 * d) % 7 for d in range(world)] for s in range(world)]  # sizes[s][d]: s sends d
    sends = [torch.randn(sum(sizes[s]), generator=g).to(dtype) for s in range(world)]

    def fn(shm, r):
        out = torch.empty(sum(sizes[s][r] for s in range(world)), dtype=dtype)
        shm.all_reduce(torch.ones(8))
        shm.all_to_all(sends[r], sizes[r], out, [sizes[s][r] for s in range(world)])
        shm.all_reduce(torch.ones(8))
        return out

    results = _run(world, fn)
    for d in range(world):
        want = torch.cat([sends[s][sum(sizes[s][:d]) : sum(sizes[s][: d + 1])] for s in range(world)])
        assert torch.equal(results[d], want)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_all_gather_gives_the_one_shot_bits(world):
    """The two-shot AllReduce (each rank sums its 1/N in rank order, then all gather) equals
    the one-shot sum bit for bit, on sizes that do not split evenly, interleaved with one-shot
    AllReduces on the same counter and buffers."""
    g = torch.Generator().manual_seed(2)
    parts = [[torch.randn(n, generator=g) for n in (4096, 1, 4093, 577, 4096)] for _ in range(world)]

    def fn(shm, r):
        out = []
        for i, p in enumerate(parts[r]):
            out.append(shm.all_reduce(p.clone(), two_shot=i % 2 == 0))
            out.append(shm.all_reduce(p.clone(), two_shot=False))
        return out

    results = _run(world, fn)
    for r in range(world):
        for i in range(0, len(results[r]), 2):
            assert torch.equal(results[r][i], results[r][i + 1]) and torch.equal(results[r][i], results[0][i])


def test_a_cpu_without_ordered_stores_keeps_the_allreduce_on_gloo(monkeypatch):
    # the flag-after-data protocol needs x86's store order; on ARM a rank could read a slot
    # before its data lands, so the group never maps the segment there
    from kvserve.distributed import shm_allreduce
    from kvserve.distributed.group import TensorParallelGroup
    from kvserve.kernels import isa

    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    assert not shm_allreduce.stores_ordered()
    group = TensorParallelGroup(0, 1, torch.device("cpu"))
    group.world = 2  # as rank 0 of two would be, without a process group to join
    group.use_shared_memory(4096, 5.0)  # returns before any collective: nothing to join
    assert group.shm is None
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    assert shm_allreduce.stores_ordered()
