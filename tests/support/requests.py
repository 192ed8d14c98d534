"""Model-free scheduler and KV-manager fixtures: real Requests built from token-id lists.

No model, no tokenizer: a step is `scheduler.schedule()` followed by
`scheduler.update_from_output` with a made-up SamplerOutput, so the scheduling rule and
the block pool can be checked in milliseconds.
"""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.sampler import SamplerOutput
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.sampling_params import SamplingParams


def make_request(
    request_id: str,
    token_ids: list[int],
    block_size: int,
    max_tokens: int | None = 1000,
    cache_salt: str | None = None,
) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, token_ids, params, block_size=block_size, cache_salt=cache_salt, max_model_len=100_000)


def make_scheduler(
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool = False,
    **config,
) -> Scheduler:
    """A real Scheduler over a real KVCacheManager; `config` goes to EngineConfig (no model is loaded)."""
    cfg = EngineConfig(
        device="cpu", dtype="float32", block_size=block_size, enable_prefix_caching=enable_prefix_caching, **config
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_prefix_caching))


def sampled_token(request: Request) -> int:
    """A deterministic 'sampled' token per request and position (distinct across requests)."""
    return (sum(map(ord, request.request_id)) * 131 + request.num_tokens * 7) % 50_000 + 1


def advance(scheduler: Scheduler, out: SchedulerOutput):
    """Apply a scheduled step as the engine would after the model ran: one made-up token
    for each request whose step reaches its last known token (`out.sampling`, in order)."""
    tokens = [sampled_token(s.request) for s in out.sampling]
    return scheduler.update_from_output(out, SamplerOutput(tokens, [None] * len(tokens), [None] * len(tokens)))


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, then `advance`."""
    out = scheduler.schedule()
    advance(scheduler, out)
    return out
