"""What the engine hands back: one RequestOutput per request per step it progressed.

Streaming consumers read the `delta_*` fields (what is new since this request's previous
output); the whole output (`token_ids`, `logprobs`) is carried by the final output only
(`finished`), so a step costs O(new tokens) per request, never a copy of everything
generated so far. `text` is the text so far on every output: an immutable string the
detokenizer already holds, shared rather than copied.

A consumer that falls behind gets outputs merged (`RequestOutput.merge`): one pending
output per request, whose deltas are the concatenation of what it missed.
"""

from __future__ import annotations

import dataclasses

from kvserve.request_state import RequestTiming


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str  # everything so far
    # the whole output: filled on the final output of the request; empty / None before
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: sampled + top-n alternatives
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    # new since the previous output of this request (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None
    num_tokens: int = 0  # output tokens so far (len(token_ids) once finished)

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
    # per prompt token from the second on (SamplingParams.prompt_logprobs): the token's
    # logprob and the top-k; on the first and the final output only
    prompt_logprobs: list[dict[int, float]] | None = None
    # a prefill/decode handoff (disagg/connector.py), on the final output: for a prefill
    # request what the decode side needs (transfer id, positions, bytes sent), for a decode
    # request whether its KV arrived; None for an ordinary request
    kv_transfer_params: dict | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(o.num_tokens for o in self.outputs)

    def merge(self, newer: "RequestOutput", text_parts: dict[int, list[str]]) -> None:
        """Fold `newer` (the next output of the same request) into this one, in place: deltas
        appended, everything else taken from `newer`. The delta lists are this output's own
        (the engine slices them fresh), so they are extended in place; delta text is gathered
        in `text_parts` (index -> pieces) and joined once by `take_text_parts`, so merging
        k outputs costs O(their deltas), not O(k^2)."""
        for mine, new in zip(self.outputs, newer.outputs):
            mine.delta_token_ids.extend(new.delta_token_ids)
            if new.delta_logprobs:
                if mine.delta_logprobs is None:
                    mine.delta_logprobs = []
                mine.delta_logprobs.extend(new.delta_logprobs)
            if new.delta_text:
                text_parts.setdefault(mine.index, []).append(new.delta_text)
            mine.text = new.text
            mine.token_ids = new.token_ids
            mine.cumulative_logprob = new.cumulative_logprob
            mine.logprobs = new.logprobs
            mine.finish_reason = new.finish_reason
            mine.stop_reason = new.stop_reason
            mine.num_tokens = new.num_tokens
        self.prompt = newer.prompt
        self.prompt_logprobs = self.prompt_logprobs or newer.prompt_logprobs
        self.finished = newer.finished
        self.num_cached_tokens = newer.num_cached_tokens
        self.timings = newer.timings
        self.kv_transfer_params = newer.kv_transfer_params or self.kv_transfer_params

    def take_text_parts(self, text_parts: dict[int, list[str]]) -> None:
        """Join the delta text gathered by `merge` into each sample's `delta_text`."""
        for c in self.outputs:
            parts = text_parts.get(c.index)
            if parts:
                c.delta_text = c.delta_text + "".join(parts)
        text_parts.clear()
