"""Starting the ranks of one tensor-parallel engine.

On one host `LLM(tensor_parallel_size=N)` / `kvserve serve --tensor-parallel-size N` starts
ranks 1..N-1 itself: spawned processes (a fresh interpreter each, so nothing of the parent's
threads or state is inherited), each building the same engine from the same config and then
following rank 0's steps (`LLMEngine.follow_steps`). Across hosts, torchrun starts every rank
and sets the env:// variables; rank 0 then serves and the others call `run_worker`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket

logger = logging.getLogger(__name__)


def launched_by_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A loopback TCP port nobody holds now (the rendezvous of ranks this host starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ranks(config) -> tuple[list[mp.Process], str]:
    """Ranks 1..N-1 of `config` on this host, and the tcp:// address this process joins as
    rank 0 (its own environment untouched, so a later engine in it starts afresh)."""
    world = config.tensor_parallel_size
    addr, port = "127.0.0.1", str(free_port())
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": addr,
               "MASTER_PORT": port}  # fmt: skip
        p = ctx.Process(target=_rank_main, args=(config, env), name=f"kvserve-rank-{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs, f"tcp://{addr}:{port}"


def _rank_main(config, env: dict[str, str]) -> None:
    # rank 0 decides when the ranks stop (it sends the stop, or its collectives' peers vanish):
    # a Ctrl-C to the terminal's process group must not kill a rank under it mid-step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    run_worker(config)


def run_worker(config) -> None:
    """A rank other than 0: build the same engine, then run each step rank 0 sends until it stops."""
    from kvserve.engine.engine import LLMEngine

    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine(config)
    try:
        engine.follow_steps()
    finally:
        engine.close()
