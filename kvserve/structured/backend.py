"""Compile a request's constraint into a grammar for one tokenizer, through llguidance.

llguidance was chosen over xgrammar by measurement (`python -m benchmarks.structured_choice`):
it compiles a schema 5-10x faster (0.3-1 ms against 4-5 ms with the default model's
tokenizer), which matters when every tool-calling request brings its own schema, and it
needs neither torch nor triton; xgrammar's mask is 2-4x cheaper per step, but both are a
small part of a decode step.

Two caches, because both costs repeat: the llguidance view of a tokenizer (~0.4 s to
build) is made once per (tokenizer, vocabulary size), and compiled grammars are kept in an
LRU by their constraint's text, since many requests reuse one schema. A compiled grammar
holds a validated template matcher; each request (each of its n samples) gets a copy
(~10 µs, against ~0.4 ms for a new matcher).

Compilation raises `InvalidRequestError` naming what the library cannot honour, with
`param` = the field the constraint came from, so the server answers 400 before queueing.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import weakref
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf

from kvserve.errors import InvalidRequestError
from kvserve.structured.matcher import GrammarMatcher, error_reason
from kvserve.structured.params import JSON_LAYOUT, StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per tokenizer; each is a few KB to a few MB
JSON_OPTIONS = JSON_LAYOUT  # structured/params.py says why


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    key: tuple[str, str]  # (kind, constraint text): the cache key
    vocab_size: int  # the mask's width: tokens at or beyond the tokenizer's own are never allowed
    _template: llguidance.LLMatcher

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start, for one sequence (one sample of a request)."""
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size)


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): what identifies a compiled grammar. Schema key order is kept, not
    sorted: it is the order properties are generated in."""
    if params.json is not None:
        return "json", json.dumps(params.json, ensure_ascii=False)
    if params.json_object:
        return "json", '{"type": "object"}'
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(list(params.choice), ensure_ascii=False)
    return "grammar", params.grammar  # type: ignore[return-value]


def _grammar_spec(kind: str, text: str, field: str) -> str:
    """llguidance's grammar definition (a JSON string) for a constraint."""
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: invalid {kind} constraint: {exc}", field) from exc


class StructuredBackend:
    """The grammar compiler of one tokenizer at one vocabulary size. Thread-safe: the
    server compiles on its side while the engine thread compiles (cache hits) on add."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int | None = None, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        # n_vocab pads the tokenizer's vocabulary to the model's (its extra rows are never
        # allowed); every end token of the model may close a grammar
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer.hf, n_vocab=self.vocab_size, eos_token=list(tokenizer.eos_token_ids) or None
        )
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = grammar_key(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(key, params.field)  # outside the lock: another schema may compile meanwhile
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, key: tuple[str, str], field: str) -> CompiledGrammar:
        kind, text = key
        spec = _grammar_spec(kind, text, field)
        # the matcher's construction is the real compile (lexer, parser tables); it never
        # raises but enters an error state, whose message names the feature, e.g.
        # 'Unimplemented keys: ["uniqueItems"]' or 'Unknown format: ...'
        template = llguidance.LLMatcher(self.ll_tokenizer, spec, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"{field}: the {kind} constraint cannot be enforced: {error_reason(template.get_error())}", field
            )
        for warning in template.get_grammar_warnings():
            logger.info("structured outputs: %s (grammar %s)", warning, kind)
        return CompiledGrammar(key, self.vocab_size, template)

    def cache_info(self) -> int:
        with self._lock:
            return len(self._cache)


_backends: "weakref.WeakKeyDictionary[Tokenizer, dict[int, StructuredBackend]]" = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()


def backend_for(tokenizer: "Tokenizer", vocab_size: int | None = None) -> StructuredBackend:
    """The one backend of this tokenizer at this vocabulary size (built on first use)."""
    with _backends_lock:
        per_size = _backends.setdefault(tokenizer, {})
        size = max(vocab_size or 0, tokenizer.vocab_size)
        backend = per_size.get(size)
        if backend is None:
            backend = per_size[size] = StructuredBackend(tokenizer, size)
        return backend


def compile_structured(
    params: StructuredOutputsParams, tokenizer: "Tokenizer", vocab_size: int | None = None
) -> CompiledGrammar:
    """Compile (or find in the cache) the grammar of `params` for `tokenizer`; `vocab_size`
    is the model's (its logits' width) where it exceeds the tokenizer's. Raises
    InvalidRequestError(param=params.field) naming what cannot be enforced."""
    return backend_for(tokenizer, vocab_size).compile(params)
