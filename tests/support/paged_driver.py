"""Drive the real engine parts (KV manager, runner, model) a step at a time and read logits.

Tests of the model and of attention need logits, which the engine samples away; this
helper runs the same calls `LLMEngine.step` makes and returns them instead.
"""

from __future__ import annotations

import torch

from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.sampling_params import SamplingParams


class PagedDriver:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._next = 0

    def new_request(self, token_ids: list[int]) -> Request:
        self._next += 1
        return Request(f"drv-{self._next}", token_ids, SamplingParams(temperature=0), block_size=self.engine.config.block_size)

    def step(self, work: list[tuple[Request, int]]) -> dict[str, torch.Tensor]:
        """Compute `n` new positions of each request in one forward; logits of those that reach the end."""
        kv = self.engine.kv_cache
        scheduled = []
        for req, n in work:
            assert kv.allocate_slots(req, n), "pool too small for the test"
            scheduled.append(ScheduledRequest(req, n))
        # what Scheduler.schedule hands the runner: the steps and, after all allocations, the block tables
        tables, group_tables = kv.tables([r.request_id for r, _ in work])
        plan = SchedulerOutput(scheduled, tables, group_block_tables=group_tables)
        batch = self.engine.runner.prepare(plan)
        logits = self.engine.runner.execute(batch)
        # the first half of Scheduler.update_from_output; the caller feeds tokens itself (`decode`)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        return {s.request.request_id: logits[i].float() for i, s in enumerate(batch.sampling)}

    def prefill(self, req: Request, chunk: int | None = None) -> torch.Tensor:
        """All remaining known tokens, in chunks of `chunk` positions; logits of the last."""
        out = None
        while req.num_computed_tokens < req.num_tokens:
            n = req.num_tokens - req.num_computed_tokens
            out = self.step([(req, min(n, chunk or n))])
        return out[req.request_id]

    def decode(self, req: Request, token: int) -> torch.Tensor:
        req.append_output_token(token)
        return self.step([(req, 1)])[req.request_id]

    def free(self, req: Request) -> None:
        self.engine.kv_cache.free(req)


def assert_follows_reference(engine: LLMEngine, reference, prompt: list[int], steps: int, atol: float, rtol: float) -> None:
    """Our logits after the prefill and after each decode step equal the reference model's
    (a full forward over the same tokens); the reference's greedy token is fed back."""
    driver = PagedDriver(engine)
    req = driver.new_request(prompt)
    ours = driver.prefill(req)
    tokens = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(ours.cpu(), expected, atol=atol, rtol=rtol)
        tokens.append(int(expected.argmax()))
        ours = driver.decode(req, tokens[-1])
    driver.free(req)
