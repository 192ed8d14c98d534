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


# how the AllReduce runs: gloo's; the engine's shared-memory one as it chooses; or that one
# forced to one shot (every rank sums every slot) or two (ReduceScatter, then AllGather)
MODES = ("gloo", "shm", "one-shot", "two-shot")


def _rank(rank: int, port: int, sizes: list[int], repeats: int, out, shared_memory: bool = False, world: int = RANKS,
          mode: str | None = None) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from kvserve.distributed.group import TensorParallelGroup

    mode = mode or ("shm" if shared_memory else "gloo")
    torch.set_num_threads(1)
    group = TensorParallelGroup.join(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    if mode != "gloo":  # the engine's same-host path (distributed/shm_allreduce.py)
        group.use_shared_memory(max(sizes), 60.0)
    if mode in ("one-shot", "two-shot") and group.shm is not None:  # None: this CPU keeps them on gloo
        two = mode == "two-shot"

        def reduce(x):
            return group.shm.all_reduce(x, two_shot=two)
    else:
        reduce = group.all_reduce
    try:
        times = []
        for n in sizes:
            x = torch.ones(n, dtype=torch.float32)
            for _ in range(3):  # warm the connection and the buffers
                reduce(x)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                reduce(x)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        if rank == 0:
            out.put(times)
    finally:
        group.close()


def measure_allreduce(width: int = DEFAULT_WIDTH, rows: tuple[int, ...] = DEFAULT_ROWS, repeats: int = 20,
                      timeout_s: float = 120.0, shared_memory: bool = False, ranks: int = RANKS,
                      mode: str | None = None) -> LinkFit:  # fmt: skip
    """Best-of-`repeats` AllReduce time of fp32 [rows, width] between `ranks` local ranks,
    fitted; gloo's, or with `shared_memory` the engine's same-host AllReduce (`mode`: one of
    MODES, overriding `shared_memory`)."""
    from kvserve.distributed.launch import free_port

    port = free_port()
    sizes = [r * width for r in rows]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, repeats, out, shared_memory, ranks, mode), daemon=True)
             for r in range(ranks)]  # fmt: skip
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
    kappa = 2 * (ranks - 1) / ranks
    slope, alpha = np.polyfit(np.array(nbytes, dtype=float) * kappa, np.array(times), 1)
    bandwidth = 1 / slope if slope > 0 else kappa * nbytes[-1] / max(times[-1], 1e-9)
    if alpha <= 0:
        # noise in the large messages tilted the line through the origin or below: the
        # smallest message (one row) is almost all latency, so its time stands for α
        alpha = times[0]
    return LinkFit(float(alpha), float(bandwidth), list(zip(nbytes, times)))


def main(argv=None) -> None:
    """python -m kvserve.planner.collectives: gloo's AllReduce against the shared-memory one
    (or, with --compare two-shot, the shared-memory one in one shot against ReduceScatter +
    AllGather), ranks on this host, alternating, per message size."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=RANKS)
    ap.add_argument("--compare", choices=["gloo", "two-shot"], default="gloo",
                    help="gloo: gloo against shared memory; two-shot: one shot against ReduceScatter + AllGather")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help=f"rows of [B, {DEFAULT_WIDTH}] fp32, comma-separated")
    args = ap.parse_args(argv)
    rows = tuple(int(r) for r in args.rows.split(","))
    a, b = ("gloo", "shm") if args.compare == "gloo" else ("one-shot", "two-shot")
    print(f"{args.ranks} ranks; {'bytes per rank':>15} " + " ".join(f"{name + ' µs':>14}" for name in (a, b)) + "  ratio")
    for _ in range(args.rounds):
        first, second = measure_allreduce(rows=rows, ranks=args.ranks, mode=a), measure_allreduce(rows=rows, ranks=args.ranks, mode=b)
        for (nbytes, x), (_, y) in zip(first.samples, second.samples):
            print(f"{nbytes:>15,} {x * 1e6:>14.1f} {y * 1e6:>14.1f}  {x / y:5.2f}x")


if __name__ == "__main__":
    main()
