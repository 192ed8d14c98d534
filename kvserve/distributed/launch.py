"""The ranks of one tensor-parallel engine: starting them, joining their group, checking that
they agree, stopping them.

On one host `LLM(tensor_parallel_size=N)` / `kvserve serve --tensor-parallel-size N` starts
ranks 1..N-1 itself, each forked from a forkserver: a clean single-threaded process that has
imported torch and the worker's module once (so a rank starts in well under a second instead of
importing torch again, and inherits nothing of the parent's threads or state), with the
parent's environment as it is at launch; where there is no forkserver (Windows), spawned
interpreters. Each runs the worker it is given (engine/tp_worker.py:
its share of the model, following rank 0's steps). Across hosts, torchrun starts every rank
and sets the env:// variables; rank 0 then serves and the others run that worker. This
module knows no engine: the worker is passed in, so distributed/ stays below engine/.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
from typing import TYPE_CHECKING, Callable

from kvserve.errors import ConfigError

if TYPE_CHECKING:  # torch only once a group is joined: `free_port` serves torch-free callers too
    from kvserve.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)

SHM_ALLREDUCE_ELEMENTS = 1 << 20  # fp32 elements per rank's slot: 4 MiB, two buffers of N slots


def launched_by_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A loopback TCP port nobody holds now (the rendezvous of ranks this host starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(config, worker_main: Callable) -> tuple[TensorParallelGroup, list[mp.Process], list[str]]:
    """This process's rank of the group `config` asks for: (the group, the ranks this process
    started, the start-up note on it). Rank 0 not started by a launcher starts ranks 1..N-1
    here, each running `worker_main(config)`; every rank's AllReduce then takes shared memory
    where all ranks share a CPU host (auto)."""
    from kvserve.distributed.group import TensorParallelGroup
    from kvserve.distributed.shm_allreduce import TWO_SHOT_MIN_ELEMENTS

    procs: list[mp.Process] = []
    if launched_by_torchrun():
        tp = TensorParallelGroup.from_env(config.torch_device, config.distributed_timeout_s)
    else:
        procs, address = start_local_ranks(config, worker_main)
        tp = TensorParallelGroup.join(0, config.tensor_parallel_size, address, config.torch_device, config.distributed_timeout_s)
    if tp.world != config.tensor_parallel_size:
        raise ConfigError("tensor_parallel_size", f"{config.tensor_parallel_size} asked, but the launcher started {tp.world} ranks")
    one_host = not launched_by_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if config.tensor_parallel_allreduce == "auto" and one_host and config.torch_device.type == "cpu":
        # a decode step's [B, D] partial sums fit (the small messages whose latency gloo
        # dominates); a long prefill chunk's larger ones go to gloo
        tp.use_shared_memory(SHM_ALLREDUCE_ELEMENTS, config.distributed_timeout_s)
    allreduce = "shared memory" if tp.shm is not None else tp.backend
    if tp.shm is not None and tp.shm.two_shot:
        allreduce += f" (ReduceScatter + AllGather from {TWO_SHOT_MIN_ELEMENTS:,} elements)"
    return tp, procs, [f"tensor parallel: rank {tp.rank} of {tp.world} ({tp.backend}; AllReduce: {allreduce})"]


def start_local_ranks(config, worker_main: Callable) -> tuple[list[mp.Process], str]:
    """Ranks 1..N-1 of `config` on this host, and the tcp:// address this process joins as
    rank 0 (its own environment untouched, so a later engine in it starts afresh)."""
    world = config.tensor_parallel_size
    addr, port = "127.0.0.1", str(free_port())
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # read once, by the server, before it forks (a no-op once it runs)
        ctx.set_forkserver_preload(["torch", worker_main.__module__])
    else:
        ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        # the whole environment as it is now: a forked rank would otherwise have the server's
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": port}  # fmt: skip
        p = ctx.Process(target=_rank_main, args=(worker_main, config, env), name=f"kvserve-rank-{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs, f"tcp://{addr}:{port}"


def _rank_main(worker_main: Callable, config, env: dict[str, str]) -> None:
    # rank 0 decides when the ranks stop (it sends the stop, or its collectives' peers vanish):
    # a Ctrl-C to the terminal's process group must not kill a rank under it mid-step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    worker_main(config)


def check_ranks_agree(tp: TensorParallelGroup, mine: dict) -> None:
    """Every rank built the same thing (`mine`: model, formats, pool, ...), or all refuse to
    start with what differed: ranks given different files or flags would compute garbage."""
    everyone = tp.gather_objects(mine)
    verdict = None
    if tp.is_driver:
        for r, theirs in enumerate(everyone):
            diff = [k for k in mine if theirs.get(k) != mine[k]]
            if diff:
                verdict = f"rank {r} differs from rank 0 in {', '.join(diff)}: " + "; ".join(
                    f"{k}: {theirs.get(k)!r} vs {mine[k]!r}" for k in diff
                )
                break
    verdict = tp.broadcast_object(verdict)
    if verdict:
        raise ConfigError("tensor_parallel_size", verdict)


def stop_ranks(tp: TensorParallelGroup, procs: list, send_stop: bool) -> None:
    """Rank 0's end of the group: the stop to the other ranks (unless the group is broken),
    leaving it, and the ranks it started joined (killed past 30 s)."""
    try:
        if send_stop and tp.is_driver:
            tp.broadcast_object(None)
    except Exception:  # a rank already gone: it has nothing left to stop
        logger.warning("tensor parallel: the stop did not reach every rank", exc_info=True)
    finally:
        tp.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
