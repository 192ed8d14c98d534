"""Constrained decoding: a request's output held to a JSON schema, a regex, a choice or a grammar.

params.py: what a request asks (`StructuredOutputsParams`, on `SamplingParams.structured_outputs`).
backend.py: `compile_structured(params, tokenizer, vocab_size)` -> CompiledGrammar (llguidance,
LRU-cached; a constraint it cannot enforce raises InvalidRequestError naming it).
matcher.py: one sequence's GrammarMatcher. mask.py: the sampler's masks. advance.py: the
scheduler's step of a matcher. Only params is imported here: llguidance loads on first use.
"""

from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
