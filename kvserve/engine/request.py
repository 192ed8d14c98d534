"""A request's life in the engine: its tokens, how many have KV, its blocks' hashes, its timing.

`num_tokens` counts every known token (prompt + sampled); `num_computed_tokens` counts those
whose K/V are in the cache. A freshly sampled token is known but not yet computed: it gets
its KV when a later step feeds it through the model (the seed's §1).

The scheduler alone writes a request's state (`Scheduler.schedule`, `update_from_output`,
`finish`); `check_stop` is the stop rule it applies to each new token.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvserve.engine.prefix_cache import hash_block
from kvserve.request_state import RequestStatus, RequestTiming
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.detokenizer import IncrementalDetokenizer
    from kvserve.structured.matcher import GrammarMatcher


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        block_size: int = 16,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        leader: "Request | None" = None,
        sample_index: int = 0,
        detokenizer: "IncrementalDetokenizer | None" = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)  # looked up per token (check_stop)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit on first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.timing = RequestTiming(arrival=time.monotonic() if arrival_time is None else arrival_time)
        self.block_size = block_size
        self._extra_keys = (cache_salt or "").encode()
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()
        # samples of one prompt (n > 1) wait for the first to prefill, then share its blocks
        self.leader = leader
        self.max_model_len = max_model_len  # the length stop; None = none (model-free tests)
        # its text, for stop strings and outputs; None where there is no tokenizer (model-free tests)
        self.detokenizer = detokenizer
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []  # per output token, when asked for
        # per prompt token from the second on, when asked for (sample 0 of n computes them)
        self.prompt_logprobs: list[dict[int, float]] = []
        seed = sampling_params.seed
        if seed is not None:
            self.generator: torch.Generator | None = torch.Generator().manual_seed((seed + sample_index) % 2**63)
        else:
            self.generator = None
        self.output_counts: dict[int, int] = {}  # for presence/frequency penalties
        # its place in the grammar of a constrained request (kvserve/structured), one per sample;
        # None when unconstrained. The sampler masks with it; the scheduler advances it.
        self.structured: "GrammarMatcher | None" = None
        # its part in a prefill/decode handoff (disagg/connector.py KVTransferParams); None: none
        self.kv_transfer = None

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to be computed: they need every prompt position's
        logits, so no position may come from the prefix cache."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.leader is None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def is_ready(self) -> bool:
        """A sample of an n > 1 request enters once the first sample's prompt is computed."""
        leader = self.leader
        return leader is None or leader.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self._all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = self._extra_keys if i == 0 else b""
            self.block_hashes.append(hash_block(parent, self._all_token_ids[i * bs : (i + 1) * bs], extra))


def check_stop(request: Request, token: int, stop_string: str | None) -> tuple[RequestStatus, int | str | None] | None:
    """Does `token`, just appended, end the request? The finishing status and the stop reason
    (the stop token id or stop string; None for end-of-sequence and length), or None.

    `stop_string` is what the detokenizer found in the new text (it searches only once
    `min_tokens` are out). Precedence: end-of-sequence (unless `ignore_eos`), a stop token,
    a stop string (those three only once `min_tokens` are out), then `max_tokens`, then
    `max_model_len`.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_id_set:
            return RequestStatus.FINISHED_STOPPED, token
        if stop_string is not None:
            return RequestStatus.FINISHED_STOPPED, stop_string
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
