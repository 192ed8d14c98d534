"""One sequence's place in its grammar: which tokens may come next, and the tokens it took.

A thin wrapper over llguidance's matcher, so the engine names four operations (mask,
accept, terminated, rollback) and never llguidance itself. The matcher never raises on
a rejected token: it enters an error state, which `accept` reports as False and `error`
describes.
"""

from __future__ import annotations

import llguidance
import llguidance.torch as llt
import torch


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size  # the bitmask covers ceil(vocab_size / 32) int32 words
        self.num_accepted = 0

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        return self._m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, one bit per token)."""
        llt.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it (then `error` says why)."""
        ok = self._m.consume_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: no token but an end token may follow."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was generated so far is a complete match (an end token would be allowed)."""
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (for speculative decoding; preemption
        keeps sampled tokens, so it needs none)."""
        if num_tokens > self.num_accepted or not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        self.num_accepted -= num_tokens

    @property
    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        return error_reason(self._m.get_error())


def error_reason(message: str) -> str:
    """llguidance's error on one line: its state dump and caret markers dropped, the reason
    (which may sit on a later line, e.g. a regex error's) kept."""
    text = message.split("<state>")[0]
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and set(line) - set("^ ")]
    return " ".join(kept) or "unknown error"
