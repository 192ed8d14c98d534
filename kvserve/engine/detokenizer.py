"""Incremental detokenization and stop strings.

Text is produced a token at a time by decoding a short window and keeping the part past
what was already read; a window ending in U+FFFD is an incomplete UTF-8 sequence, so the
text waits for the next token. Stop strings are searched only in the newly reachable tail,
so one split across tokens is still found. While a request runs, the last
(longest stop − 1) characters are held back from streaming, so a stop string is never
half-sent before it is recognised.
"""

from __future__ import annotations

from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import SamplingParams

# Tokens of the prompt decoded with the first output tokens, so a leading space or a
# multi-token character at the boundary renders as it would in the full text.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self._sent = 0  # characters of output_text already handed out

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token's text; return the stop string that ended the request, if any."""
        self.ids.append(token_id)
        skip = self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        if check_stop and self.params.stop:
            return self._find_stop(len(delta))
        return None

    def _find_stop(self, delta_len: int) -> str | None:
        text = self.output_text
        start = max(0, len(text) - delta_len - self.params.max_stop_str_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.output_text = text[:end]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus a possible stop-string prefix while running."""
        hold = 0 if finished or not self.params.stop else self.params.max_stop_str_len - 1
        end = max(self._sent, len(self.output_text) - hold)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta
