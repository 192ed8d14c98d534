"""The link a tensor-parallel collective uses, measured on this host (`kvserve plan calibrate`).

Two ranks (spawned processes, gloo, the backend kvserve's tensor parallelism uses on CPU)
time an AllReduce of fp32 [B, D] partial sums over a range of sizes, the messages a TP step
sends (B rows of a model width D, 1 to 4,096 so the bandwidth term shows beside α). The fit t = α + κ·bytes/bandwidth (ring
AllReduce: κ = 2(n−1)/n, 1 for two ranks) by least squares gives the α and the link bandwidth
the planner's collective time uses (planner/parallel.py), measured instead of assumed.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

import numpy as np

RANKS = 2
KAPPA = 2 * (RANKS - 1) / RANKS
DEFAULT_WIDTH = 576  # SmolLM2's D; any model width works, the fit is per byte
DEFAULT_ROWS = (1, 16, 256, 1024, 4096)  # up to 9.4 MB: large enough for the bandwidth term to show


@dataclass(frozen=True)
class LinkFit:
    latency_s: float  # α, one collective's fixed cost
    bytes_per_s: float  # the bandwidth κ·bytes is divided by
    samples: list[tuple[int, float]]  # (bytes per rank, best seconds)


def _rank(rank: int, port: int, sizes: list[int], repeats: int, out, shared_memory: bool = False) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.distributed.group import TensorParallelGroup

    torch.set_num_threads(1)
    group = TensorParallelGroup.join(rank, RANKS, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    if shared_memory:  # the engine's same-host path (distributed/shm_allreduce.py)
        group.use_shared_memory(max(sizes), 60.0)
    try:
        times = []
        for n in sizes:
            x = torch.ones(n, dtype=torch.float32)
            for _ in range(3):  # warm the connection and the buffers
                group.all_reduce(x)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                group.all_reduce(x)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        if rank == 0:
            out.put(times)
    finally:
        group.close()


def measure_allreduce(width: int = DEFAULT_WIDTH, rows: tuple[int, ...] = DEFAULT_ROWS, repeats: int = 20,
                      timeout_s: float = 120.0, shared_memory: bool = False) -> LinkFit:  # fmt: skip
    """Best-of-`repeats` AllReduce time of fp32 [rows, width] between two local ranks, fitted;
    gloo's, or with `shared_memory` the engine's same-host AllReduce."""
    from kvserve.distributed.launch import free_port

    port = free_port()
    sizes = [r * width for r in rows]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, repeats, out, shared_memory), daemon=True)
             for r in range(RANKS)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        times = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    nbytes = [n * 4 for n in sizes]
    # t = α + κ·bytes/bw: a line in bytes, least squares; a non-positive slope means the link
    # is faster than this range can tell, and the largest message bounds it
    slope, alpha = np.polyfit(np.array(nbytes, dtype=float) * KAPPA, np.array(times), 1)
    bandwidth = 1 / slope if slope > 0 else KAPPA * nbytes[-1] / max(times[-1], 1e-9)
    return LinkFit(max(float(alpha), 0.0), float(bandwidth), list(zip(nbytes, times)))


def main(argv=None) -> None:
    """python -m kvserve.planner.collectives: gloo's AllReduce against the shared-memory one,
    two ranks on this host, alternating, per message size."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"{'bytes per rank':>15} " + " ".join(f"{name + ' µs':>14}" for name in ("gloo", "shared memory")) + "  ratio")
    for _ in range(args.rounds):
        gloo, shm = measure_allreduce(), measure_allreduce(shared_memory=True)
        for (nbytes, g), (_, m) in zip(gloo.samples, shm.samples):
            print(f"{nbytes:>15,} {g * 1e6:>14.1f} {m * 1e6:>14.1f}  {g / m:5.1f}x")


if __name__ == "__main__":
    main()
