"""Input processing: a request checked and tokenized once, then fanned out into its n samples.

The caller's side, so the server does the slow part off its event loop: `tokenize` checks the
sampling parameters (token ids in the vocabulary, a grammar that can be enforced, compiled
and cached) and the prompt (not empty, in the vocabulary, within max_model_len) and tokenizes
it (the server: AsyncLLMEngine.prepare_prompt, in a worker thread); `process` adds a handoff's
part and returns the `NewRequest` the engine adds. The engine's side: `fan_out` makes its n
samples, each a `Request` the scheduler runs on its own (the first leads; the others wait for
its prompt and share its blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import TYPE_CHECKING, Sequence

from kvserve.disagg.connector import KVTransferParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError, PromptTooLongError
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.structured.backend import CompiledGrammar


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request checked and tokenized, as the engine adds it."""

    request_id: str
    prompt: str | None  # its text, where it came as text
    prompt_token_ids: list[int]
    params: SamplingParams  # a prefill for a handoff: stopped at its first token
    arrival_time: float
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None
    grammar: "CompiledGrammar | None" = None  # a constrained request's (each sample walks it on its own)


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, block_size: int, kv_role: str,
                 handoff_refusal: str | None = None):  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.kv_role = kv_role
        self.handoff_refusal = handoff_refusal  # why this instance takes no handoffs; None: it does

    # ---- the caller's side -------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Check the parameters and the prompt, and tokenize it; raises typed errors for 4xx
        answers. Blocking (tokenization, a grammar's first compile)."""
        params.check_vocab(self.vocab_size)
        self.compile_structured(params)  # a constraint it cannot enforce is a 400; cached for `process`
        ids = self.tokenize_prompt(prompt)
        self.check_prompt_length(len(ids))
        return ids

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        vocab = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})", "prompt")
        return ids

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens, more than max_model_len={self.max_model_len}",
                "prompt",
            )

    def check_prompt_length_before_tokenizing(self, prompt: str | Sequence[int]) -> None:
        """Reject a prompt known to be too long without tokenizing it: a token-id prompt's
        length is known; a text's token count is at least its characters over the most
        characters one token covers (sound for tokenizers that drop no input; see
        `longest_token_chars`)."""
        if not isinstance(prompt, str):
            self.check_prompt_length(len(prompt))
            return
        longest = self.longest_token_chars
        if longest:
            at_least = -(-len(prompt) // longest)
            if at_least > self.max_model_len:
                raise PromptTooLongError(
                    f"the prompt has at least {at_least} tokens ({len(prompt)} characters), more than "
                    f"max_model_len={self.max_model_len}",
                    "prompt",
                )

    @functools.cached_property
    def longest_token_chars(self) -> int | None:
        """The most input characters one token can cover (`_longest_token_chars`)."""
        return _longest_token_chars(self.tokenizer)

    def compile_structured(self, params: SamplingParams) -> "CompiledGrammar | None":
        """The compiled grammar of a constrained request (LRU-cached), None when unconstrained.
        Raises InvalidRequestError naming a constraint the grammar library cannot enforce."""
        if params.structured_outputs is None:
            return None
        from kvserve.structured.backend import compile_structured  # llguidance only once needed

        return compile_structured(params.structured_outputs, self.tokenizer, self.vocab_size)

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prompt_text: str | None = None,
                arrival_time: float | None = None, cache_salt: str | None = None,
                kv_transfer: KVTransferParams | dict | None = None) -> NewRequest:  # fmt: skip
        """The request the engine adds, from a prompt `tokenize` checked: its handoff's part
        checked too, and its grammar (compiled by `tokenize`) taken from the cache."""
        if kv_transfer is not None:
            kv_transfer, params = self._check_kv_transfer(kv_transfer, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return NewRequest(request_id, prompt_text, prompt_token_ids, params, arrival, cache_salt, kv_transfer,
                          self.compile_structured(params))  # fmt: skip

    def _check_kv_transfer(self, kv_transfer, params: SamplingParams) -> tuple[KVTransferParams, SamplingParams]:
        """A handoff this instance can take part in; a prefill request stops at its first token."""
        if not isinstance(kv_transfer, KVTransferParams):
            kv_transfer = KVTransferParams.from_dict(kv_transfer)
        if self.handoff_refusal is not None:
            raise InvalidRequestError(f"kv_transfer_params: {self.handoff_refusal}", "kv_transfer_params")
        role = self.kv_role
        if kv_transfer.do_remote_decode and role == "decode":
            raise InvalidRequestError("kv_transfer_params: this is a decode instance (--role decode); it does not prefill for others",
                                      "kv_transfer_params")  # fmt: skip
        if kv_transfer.do_remote_prefill and role == "prefill":
            raise InvalidRequestError("kv_transfer_params: this is a prefill instance (--role prefill); it does not receive KV",
                                      "kv_transfer_params")  # fmt: skip
        if params.n != 1 and kv_transfer.do_remote_decode:
            raise InvalidRequestError("kv_transfer_params: a prefill for a handoff samples one first token (n = 1)", "n")
        if kv_transfer.do_remote_decode:  # the first token, then the decode side goes on
            params = dataclasses.replace(params, max_tokens=1, min_tokens=0)
        return kv_transfer, params

    # ---- the engine's side -------------------------------------------------------------

    def fan_out(self, new: NewRequest) -> list[Request]:
        """The request's n samples: one request id each (`id#i` when n > 1), a detokenizer and
        a grammar matcher each; the first takes a handoff, the others its prompt's blocks."""
        params, prompt_ids, n = new.params, new.prompt_token_ids, new.params.n
        samples: list[Request] = []
        for i in range(n):
            sample = Request(
                new.request_id if n == 1 else f"{new.request_id}#{i}", prompt_ids, params,
                eos_token_ids=self.tokenizer.eos_token_ids, arrival_time=new.arrival_time, block_size=self.block_size,
                cache_salt=new.cache_salt, max_model_len=self.max_model_len, leader=samples[0] if i else None, sample_index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params),
            )  # fmt: skip
            if new.grammar is not None:  # each sample walks the grammar on its own
                sample.structured = new.grammar.new_matcher()
            samples.append(sample)
        if new.kv_transfer is not None:  # the first sample takes the handoff; the others its prefix
            t = samples[0].kv_transfer = new.kv_transfer
            t.request_id, t.prompt_token_ids = samples[0].request_id, prompt_ids
        return samples


def _longest_token_chars(tokenizer) -> int | None:
    """The most input characters one token can cover, from the vocabulary, or None where that
    is not a sound bound. Byte-level BPE (each input byte becomes one symbol) and SentencePiece
    (a space becomes "▁") drop nothing, so a token covers at most as many input characters as
    its vocabulary string has symbols (a byte-fallback "<0xE2>" covers less). Tokenizers that
    strip whitespace or normalize text shorter (WordPiece, NFKC, …) get no bound."""
    backend = getattr(getattr(tokenizer, "hf", None), "_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.hf.get_vocab()
    except Exception:
        return None
    if not _drops_nothing(spec.get("normalizer"), {"Prepend", "Replace"}) or not _drops_nothing(
        spec.get("pre_tokenizer"), {"ByteLevel", "Metaspace", "Split", "Digits"}
    ):
        return None
    return max((len(t) for t in vocab), default=0) or None


def _drops_nothing(component: dict | None, allowed: set[str]) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return all(_drops_nothing(p, allowed) for p in parts)
    if kind == "Split" and str(component.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace":  # a space to "▁" keeps the length; anything else may shorten
        pattern = component.get("pattern", {})
        source = pattern.get("String") if isinstance(pattern, dict) else None
        return source is not None and len(source) == 1 and len(component.get("content", "")) >= 1
    return kind in allowed
