"""Shared pieces of the simulator tests: a synthetic step model and hand-made requests."""

from __future__ import annotations

import dataclasses

from kvserve.sim.instance import InstanceSpec
from kvserve.sim.simulator import Deployment
from kvserve.sim.step_model import StepTimeModel
from kvserve.sim.workload import SimRequest

# every coefficient non-zero, so a test of a step's time also checks the step's shape
BASE = StepTimeModel(
    fixed=0.002, per_row=0.0005, per_decode_row=0.001, per_prefill_token=0.0001, per_mixed_prefill_token=0.00002,
    per_decode_kv=1e-6, per_prefill_kv=2e-7, per_pair=1e-8, per_sample=0.0003, kv_bytes_per_position=1024,
    model_len=4096, num_layers=4, d_model=64, num_kv_heads=2, label="synthetic", model_name="synthetic",
)
BLOCK_BYTES = 16 * 1024  # one 16-position block at BASE's c_kv


def synthetic_model(**changes) -> StepTimeModel:
    return dataclasses.replace(BASE, **changes)


def prompt(n: int, start: int = 0) -> list[int]:
    """n token ids no other call with a different `start` shares (no accidental prefix hit)."""
    return [1 + (start * 7919 + j) % 30000 for j in range(n)]


def request(i: int, prompt_len: int, output_len: int, arrival_s: float = 0.0, prefix: list[int] = ()) -> SimRequest:
    return SimRequest(f"r{i}", arrival_s, [*prefix, *prompt(prompt_len, start=1000 + i)], output_len)


# a pool of 4096 blocks (65,536 positions): ample for these tests, and quick to build (the default 1 GiB
# makes 65,536 blocks, a sixth of a second per simulated instance)
POOL = InstanceSpec(kv_cache_memory=4096 * BLOCK_BYTES)


def deployment(**fields) -> Deployment:
    return Deployment(**{"instance": POOL, **fields})
