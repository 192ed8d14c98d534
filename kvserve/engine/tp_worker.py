"""A tensor-parallel rank other than 0: its share of the model and a runner, following rank 0's
steps until rank 0 stops it.

Rank 0's engine schedules, samples and answers; every other rank only runs each step's forward
pass on its share (its heads, FFN columns and vocabulary rows), making the same collective
calls in the same order (model_runner.py `StepMessage`). So it holds no scheduler, no KV
manager (rank 0's decides which blocks each request writes) and no sampler. Started by rank 0
on one host (distributed/launch.py `start_local_ranks`), or by torchrun on ranks other than 0
(`kvserve serve`).
"""

from __future__ import annotations

import logging

from kvserve.distributed.launch import join_group
from kvserve.engine.model_share import build_model_share, use_process_settings


def run_worker(config) -> None:
    logging.basicConfig(level=logging.WARNING)
    use_process_settings(config)
    tp, _, notes = join_group(config, run_worker)
    try:
        runner = build_model_share(config, tp, None, notes).runner
        while (msg := tp.broadcast_object(None)) is not None:
            runner.run_step_message(msg)
    finally:
        tp.close()
