"""The same-host shared-memory AllReduce (distributed/shm_allreduce.py): the ranks here are
threads of one process mapping the same segment, which the protocol does not distinguish
from processes. Sums in rank order (every rank the same bits), many collectives in a row
(the double buffering), a rank that never arrives named in the error."""

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
