"""What the engine hands back: one RequestOutput per request per step it progressed."""

from __future__ import annotations

import dataclasses

from kvserve.engine.request import RequestTiming


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str  # everything so far
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: sampled + top-n alternatives
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    # new since the previous output of this request (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    timings: list[RequestTiming] = dataclasses.field(default_factory=list)  # one per sample

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
