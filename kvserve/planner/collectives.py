"""The link a tensor-parallel collective uses, measured on this host (`kvserve plan calibrate`).

Two ranks (spawned processes, gloo, the backend kvserve's tensor parallelism uses on CPU)
time an AllReduce of fp32 [B, D] partial sums over a range of sizes, the messages a TP step
sends (B rows of a model width D, 1 to 4,096 so the bandwidth term shows beside α). The fit t = α + κ·bytes/bandwidth (ring
AllReduce: κ = 2(n−1)/n, 1 for two ranks) by least squares gives the α and the link bandwidth
the planner's collective time uses (planner/parallel.py), measured instead of assumed.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
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


def _rank(rank: int, port: int, sizes: list[int], repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        times = []
        for n in sizes:
            x = torch.ones(n, dtype=torch.float32)
            for _ in range(3):  # warm the connection and the buffers
                dist.all_reduce(x)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def measure_allreduce(width: int = DEFAULT_WIDTH, rows: tuple[int, ...] = DEFAULT_ROWS, repeats: int = 20,
                      timeout_s: float = 120.0) -> LinkFit:  # fmt: skip
    """Best-of-`repeats` AllReduce time of fp32 [rows, width] between two local ranks, fitted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [r * width for r in rows]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, repeats, out), daemon=True) for r in range(RANKS)]
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
