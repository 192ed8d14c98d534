"""Output processing: what the user sees of the requests a step moved on.

One `RequestOutput` per user request per step that progressed it: its n samples (each a
`Request` the scheduler runs on its own, the first their leader) grouped back together,
each with the text and tokens new since its last output. A running sample's new text is
its detokenizer's, minus a possible stop string's beginning (held back until the stop is
ruled out); the detokenizer itself takes each token in the scheduler's update, where the
stop strings decide whether the sample ends (engine/scheduler.py). The final output hands
over the whole token and logprob lists and, for a handoff, its result (disagg/connector.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from kvserve.engine.input_processor import NewRequest
from kvserve.engine.request import Request
from kvserve.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass
class _Samples:
    """One user request: n samples of one prompt, reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    sent_tokens: list[int]  # per sample: output tokens already handed out

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, connector=None):
        self.connector = connector  # disagg/connector.py KVConnector: a handoff's result, on its final output
        self._requests: dict[str, _Samples] = {}  # user request id -> its samples
        self._of_sample: dict[str, _Samples] = {}  # sample request id -> its user request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, new: NewRequest, samples: list[Request]) -> None:
        group = _Samples(new.request_id, new.prompt, new.prompt_token_ids, samples, [0] * len(samples))
        self._requests[new.request_id] = group
        for s in samples:
            self._of_sample[s.request_id] = group

    def samples(self, request_id: str) -> list[Request] | None:
        """The samples of a user request not yet reported finished; None: no such request."""
        group = self._requests.get(request_id)
        return None if group is None else group.samples

    def output(self, request_id: str) -> RequestOutput:
        return self._emit(self._requests[request_id])

    def outputs(self, moved: Iterable[Request]) -> list[RequestOutput]:
        """One output per user request with a sample in `moved`, in the order first seen."""
        touched = {g.request_id: g for g in (self._of_sample[r.request_id] for r in moved)}
        return [self._emit(g) for g in touched.values()]

    def _emit(self, group: _Samples) -> RequestOutput:
        # O(new tokens) per step: the deltas are sliced fresh; the whole output (token ids,
        # logprobs) is handed over once, on the final output, as the finished requests' own
        # lists (nothing appends to them any more), never copied each step
        finished = group.finished
        first = not any(group.sent_tokens)
        outputs = []
        for i, sample in enumerate(group.samples):
            detok = sample.detokenizer
            start = group.sent_tokens[i]
            group.sent_tokens[i] = sample.num_output_tokens
            want_logprobs = sample.sampling_params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=detok.output_text,
                    token_ids=sample.output_token_ids if finished else [],
                    cumulative_logprob=sample.cumulative_logprob if want_logprobs else None,
                    logprobs=(sample.logprobs if finished else None) if want_logprobs else None,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    delta_text=detok.take_delta(sample.is_finished),
                    delta_token_ids=sample.output_token_ids[start:],
                    delta_logprobs=sample.logprobs[start:] if want_logprobs else None,
                    num_tokens=sample.num_output_tokens,
                )
            )
        if finished:
            del self._requests[group.request_id]
            for sample in group.samples:
                self._of_sample.pop(sample.request_id, None)
        lead = group.samples[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=lead.num_cached_tokens,
            timings=[s.timing for s in group.samples],
            # complete once the first token is out (the prompt is computed by then); handed
            # over on the first output and the final one, uncopied
            prompt_logprobs=lead.prompt_logprobs if lead.sampling_params.prompt_logprobs is not None and (first or finished) else None,
            kv_transfer_params=self.connector.handoff_result(lead) if finished and lead.kv_transfer is not None else None,
        )
