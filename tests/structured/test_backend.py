"""The grammar backend with a tiny tokenizer: compile, cache, typed errors, masks, the
matcher's step in a request's life. No model; milliseconds each."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine.request import Request
from kvserve.request_state import RequestStatus
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import SamplingParams
from kvserve.structured.advance import advance_structured
from kvserve.structured.backend import StructuredBackend, compile_structured
from kvserve.structured.mask import apply_grammar_masks, bitmask_to_bias, bitmask_to_bool, fill_bitmasks
from kvserve.structured.params import StructuredOutputsParams as S
from tests.support.tiny_models import build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())


@pytest.fixture(scope="module")
def backend(tokenizer) -> StructuredBackend:
    return StructuredBackend(tokenizer, tokenizer.vocab_size + 13, cache_size=3)  # a model wider than its tokenizer


def _allowed(matcher, vocab: int) -> torch.Tensor:
    return bitmask_to_bool(fill_bitmasks([matcher], vocab), vocab)[0]


def test_a_valid_document_walks_through_its_masks(backend, tokenizer):
    matcher = backend.compile(S(json=SCHEMA)).new_matcher()
    tokens = tokenizer.encode(json.dumps({"name": "fox", "n": 12}), add_special_tokens=False)
    for t in tokens:
        allowed = _allowed(matcher, backend.vocab_size)
        assert allowed[t], tokenizer.decode([t])
        assert not allowed[tokenizer.vocab_size :].any()  # the model's padding rows: never
        assert matcher.accept(t)
    assert matcher.is_terminated and matcher.error is None
    allowed = _allowed(matcher, backend.vocab_size)
    assert set(allowed.nonzero().flatten().tolist()) <= set(tokenizer.eos_token_ids)


def test_rejected_token_is_an_error_state_and_rollback(backend, tokenizer):
    matcher = backend.compile(S(regex="ab+c")).new_matcher()
    a, b = (tokenizer.encode(x, add_special_tokens=False)[0] for x in "ab")
    assert matcher.accept(a) and matcher.accept(b)
    matcher.rollback(1)
    assert matcher.num_accepted == 1 and matcher.accept(b)
    with pytest.raises(ValueError):
        matcher.rollback(5)
    z = tokenizer.encode("z", add_special_tokens=False)[0]
    assert not matcher.accept(z) and matcher.error


def test_compiled_grammars_are_cached_lru(backend):
    first = backend.compile(S(choice=("yes", "no")))
    assert backend.compile(S(choice=["yes", "no"])) is first  # same text, same grammar
    for regex in ("a+", "b+", "c+"):
        backend.compile(S(regex=regex))
    assert backend.cache_info() == 3 and backend.compile(S(choice=("yes", "no"))) is not first  # evicted


def test_one_backend_per_tokenizer(tokenizer):
    a = compile_structured(S(json_object=True), tokenizer)
    assert compile_structured(S(json_object=True), tokenizer) is a


@pytest.mark.parametrize(
    "params, named",
    [
        (S(json={"type": "array", "uniqueItems": True}, field="response_format"), "uniqueItems"),
        (S(json={"if": {"type": "string"}, "then": {"minLength": 2}}), '"if"'),
        (S(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
        (S(json={"type": "string", "pattern": "(?=a)b"}), "look-around"),
        (S(regex="(abc"), "unclosed group"),
        (S(grammar="start: missing_rule", field="tool_choice"), "missing_rule"),
    ],
)
def test_what_cannot_be_enforced_is_a_named_400(backend, params, named):
    with pytest.raises(InvalidRequestError) as err:
        backend.compile(params)
    assert named in str(err.value) and err.value.param == params.field
    assert "\n" not in str(err.value)  # llguidance's state dump stays out of the message


def test_bitmask_unpacks_bit_j_of_word_w_to_token_32w_plus_j():
    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    naive = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(128)] for r in range(3)]).bool()
    assert torch.equal(bitmask_to_bool(bitmask, 100), naive[:, :100])
    padded = bitmask_to_bool(bitmask, 130)  # a vocabulary wider than the mask: the rest disallowed
    assert torch.equal(padded[:, :128], naive) and not padded[:, 128:].any()
    bias = bitmask_to_bias(bitmask, 130)  # what the sampler adds: 0 where allowed, -inf elsewhere
    assert torch.equal(bias == 0, padded) and torch.isinf(bias[~padded]).all()


def test_masks_touch_only_the_constrained_rows(backend):
    vocab = backend.vocab_size
    logits = torch.randn(4, vocab)
    before = logits.clone()
    matchers = [backend.compile(S(choice=("yes", "no"))).new_matcher(), backend.compile(S(regex="[0-9]+")).new_matcher()]
    apply_grammar_masks(logits, [1, 3], matchers)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, m in zip([1, 3], matchers):
        allowed = _allowed(m, vocab)
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert torch.isinf(logits[row][~allowed]).all() and allowed.any()


def _request(matcher, max_tokens=8) -> Request:
    req = Request("r", [1, 2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    req.structured = matcher
    return req


def test_advance_stops_on_completion_and_aborts_on_rejection(backend, tokenizer):
    yes = tokenizer.encode("yes", add_special_tokens=False)
    req = _request(backend.compile(S(choice=("yes", "no"))).new_matcher())
    for t in yes[:-1]:
        assert advance_structured(req, t, None) is None
    # complete on the last token: "stop", even under ignore_eos and at max_tokens
    assert advance_structured(req, yes[-1], (RequestStatus.FINISHED_LENGTH, None)) == (RequestStatus.FINISHED_STOPPED, None)
    req = _request(backend.compile(S(choice=("yes", "no"))).new_matcher())
    z = tokenizer.encode("z", add_special_tokens=False)[0]
    assert advance_structured(req, z, None) == (RequestStatus.FINISHED_ABORTED, None)
    assert advance_structured(_request(None), z, None) is None
