"""The tensor-parallel process group: torch.distributed with env:// initialisation.

gloo on CPU, NCCL on CUDA; rank 0 schedules and samples, every rank runs its share of each
forward pass. `env://` reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, so the same code
runs under `torchrun --nnodes M --nproc-per-node K` across hosts and under kvserve's own
one-host launcher (distributed/launch.py). Every collective has a timeout: a rank that dies
or hangs fails the others' next collective instead of hanging them.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from kvserve.errors import ConfigError

DEFAULT_TIMEOUT_S = 120.0


class TensorParallelGroup:
    """This process's rank in the group, and the collectives the model and engine use."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank = rank
        self.world = world
        self.device = device
        self.backend = dist.get_backend() if world > 1 else "none"
        self.shm = None  # shm_allreduce.ShmAllReduce once use_shared_memory ran
        # time this rank spent inside collectives (waiting included), by kind: what
        # `kvserve bench latency --tensor-parallel-size N` sets beside the step time
        kinds = ("all_reduce", "all_gather", "all_to_all", "broadcast")
        self.comm_seconds: dict[str, float] = dict.fromkeys(kinds, 0.0)
        self.comm_calls: dict[str, int] = dict.fromkeys(kinds, 0)

    def _timed(self, kind: str, t0: float) -> None:
        self.comm_seconds[kind] += time.perf_counter() - t0
        self.comm_calls[kind] += 1

    @classmethod
    def from_env(cls, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> "TensorParallelGroup":
        """Join the group named by the environment (env://: torchrun, or the one-host launcher
        in the ranks it starts); one process alone if WORLD_SIZE is unset or 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        return cls.join(rank, world, "env://", device, timeout_s, int(os.environ.get("LOCAL_RANK", "0")))

    @classmethod
    def join(cls, rank: int, world: int, init_method: str, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
             local_rank: int = 0) -> "TensorParallelGroup":  # fmt: skip
        """Join as `rank` of `world` through `init_method` (env:// or tcp://host:port)."""
        if world > 1 and dist.is_initialized():
            raise ConfigError(
                "tensor_parallel_size", "this process already belongs to a tensor-parallel group: one such engine per process"
            )
        if world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        return cls(rank, world, device)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules, samples and serves."""
        return self.rank == 0

    def use_shared_memory(self, max_elements: int, timeout_s: float) -> None:
        """Every rank on this host: AllReduces of up to `max_elements` fp32 elements go through
        a shared segment (shm_allreduce.py) instead of gloo's sockets. Collective: all ranks call it.
        On a CPU without ordered stores (ARM) it leaves them on gloo (shm_allreduce.stores_ordered)."""
        from kvserve.distributed.shm_allreduce import ShmAllReduce, stores_ordered, two_shot_pays

        if self.world == 1 or not stores_ordered():
            return
        setup = None
        if self.is_driver:
            self.shm = ShmAllReduce(None, 0, self.world, max_elements, timeout_s)
            setup = (self.shm.path, two_shot_pays(self.world))
        path, two_shot = self.broadcast_object(setup)
        if not self.is_driver:
            self.shm = ShmAllReduce(path, self.rank, self.world, max_elements, timeout_s)
        self.shm.two_shot = two_shot
        dist.barrier()  # every rank has mapped it: its name can go
        if self.is_driver:
            self.shm.unlink()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over ranks, in place (a row-parallel projection's partial sums): through shared
        memory where every rank is on this host and x fits, else gloo/NCCL."""
        if self.world > 1:
            t0 = time.perf_counter()
            if self.shm is not None and self.shm.fits(x):
                self.shm.all_reduce(x)
            else:
                dist.all_reduce(x)
            self._timed("all_reduce", t0)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's x [..., sizes[r]] joined along the last dimension, on every rank
        (vocab-parallel logits; the last rank's share may be shorter)."""
        if self.world == 1:
            return x
        width = max(sizes)
        padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        t0 = time.perf_counter()
        dist.all_gather(parts, padded.contiguous())
        self._timed("all_gather", t0)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def all_to_all(self, x: torch.Tensor, in_splits: list[int], out_splits: list[int], largest_send: int) -> torch.Tensor:
        """x (1-D) cut into `in_splits` elements per destination rank, in rank order; returns
        what every rank sent this one, `out_splits` elements per source rank, joined in rank
        order (the requests layout's Q and attention-output moves). `largest_send`: the most
        elements any rank sends in this collective, so every rank picks the same transport
        (shared memory where every rank is on this host and it fits, else gloo/NCCL)."""
        out = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
        if self.world == 1:
            return out.copy_(x)
        t0 = time.perf_counter()
        if self.shm is not None and x.device.type == "cpu" and self.shm.fits_all_to_all(largest_send, x.element_size()):
            self.shm.all_to_all(x.contiguous(), in_splits, out, out_splits)
        else:
            dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits)
        self._timed("all_to_all", t0)
        return out

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; the step's inputs)."""
        if self.world == 1:
            return obj
        box = [obj]
        t0 = time.perf_counter()
        dist.broadcast_object_list(box, src=0)
        self._timed("broadcast", t0)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (start-up checks); None elsewhere."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
