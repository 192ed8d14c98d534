"""Sampling: seeds reproduce, top-k 1 is greedy, filters never pick outside their set,
penalties and bias change logits as defined, invalid values are named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, filter_logits
from kvserve.errors import InvalidRequestError

PROMPTS = ["The quick brown fox", "hello world", "What is the capital of France?"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)


def _texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_runs_reproduce_alone_or_batched(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _texts(llm.generate(PROMPTS[0], params))
    batched = _texts(llm.generate(PROMPTS, [params, SamplingParams(temperature=1.0, max_tokens=5), params]))
    assert batched[0] == alone[0] and batched[2] != []
    other_seed = _texts(llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)))
    assert other_seed != alone


def test_top_k_1_equals_greedy(llm):
    greedy = _texts(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    top1 = _texts(llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)))
    assert top1 == greedy


def test_greedy_from_the_lm_head_argmax_equals_greedy_from_logits(tiny_llama):
    """A plain-greedy step gets its tokens from the LM head's argmax epilogue (bf16, AMX,
    9-128 rows), writing no logits; asking for logprobs takes the logits path. Same tokens."""
    llm = LLM(tiny_llama, dtype="bfloat16", device="cpu", kv_cache_memory="8MiB", block_size=4)
    model = llm.engine.runner.model
    if model.kernels.argmax_epilogue.enabled:  # the fused path exists here: make sure it is taken
        assert model.lm_head.argmax(torch.randn(12, model.arch.hidden_size).bfloat16()) is not None
    prompts = [f"request {i} asks about {'foxes' if i % 2 else 'the capital of France'}" for i in range(12)]
    fused = _texts(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    from_logits = _texts(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)))
    assert fused == from_logits and all(len(t) == 8 for t in fused)


def test_logprobs_hold_sampled_and_top_n(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert entry[token] == max(entry.values()) and entry[token] <= 0
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total)


def _allowed(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Independent reading of the definitions, token by token."""
    probs = logits.softmax(-1)
    order = sorted(range(len(probs)), key=lambda i: (-float(logits[i]), i))
    allowed = set(order[:top_k]) if top_k else set(order)
    kept = [i for i in order if i in allowed]
    renorm = probs[kept] / probs[kept].sum()
    mass, nucleus = 0.0, set()
    for i, p in zip(kept, renorm.tolist()):
        if mass < top_p or not nucleus:
            nucleus.add(i)
        mass += p
    out = nucleus
    if min_p:
        sub = torch.full_like(logits, float("-inf"))
        sub[list(out)] = logits[list(out)]
        p2 = sub.softmax(-1)
        out = {i for i in out if p2[i] >= min_p * p2.max()}
    return out


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
    seed=st.integers(0, 2**31),
)
def test_filters_never_pick_outside_the_allowed_set(logits, top_k, top_p, min_p, seed):
    x = torch.tensor(logits, dtype=torch.float32)
    filtered = filter_logits(x.unsqueeze(0), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    survivors = {i for i in range(len(x)) if filtered[i] > float("-inf")}
    assert int(x.argmax()) in survivors
    # ties at the nucleus edge may be ordered either way; compare on distinct values, distinct
    # as the filter sees them (float32: two float64 logits can round to one float32)
    if len(set(x.tolist())) == len(logits):
        assert survivors <= _allowed(x, top_k, top_p, min_p) | {int(x.argmax())}
    req = Request("r", [1], SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed))
    for _ in range(5):
        token = Sampler()(x.unsqueeze(0).clone(), [req]).token_ids[0]
        assert token in survivors


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    f = filter_logits(logits, torch.tensor([0]), torch.tensor([0.8]), torch.tensor([0.0]))
    assert torch.isfinite(f[0]).tolist() == [True, True, False, False]
    f = filter_logits(logits, torch.tensor([0]), torch.tensor([0.81]), torch.tensor([0.0]))
    assert torch.isfinite(f[0]).tolist() == [True, True, True, False]
    f = filter_logits(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.4]))
    assert torch.isfinite(f[0]).tolist() == [True, True, False, False]  # 0.15 < 0.4·0.5


def _logits_after(params: SamplingParams, logits, prompt, outputs) -> torch.Tensor:
    """The sampler's logit processing (bias, penalties) for one request."""
    from kvserve.engine import sampler

    req = Request("r", prompt, params)
    for t in outputs:
        req.append_output_token(t)
    x = torch.tensor([logits], dtype=torch.float32)
    sampler._apply_bias_and_min_tokens(x, [req])
    sampler._apply_penalties(x, [req])
    return x[0]


def test_penalties_as_defined():
    logits = [2.0, -1.0, 0.5, 1.0, -2.0]
    prompt, outputs = [0, 1], [2, 2, 3]
    # repetition: tokens in prompt or output; positive logits divided, negative multiplied
    got = _logits_after(SamplingParams(repetition_penalty=2.0), logits, prompt, outputs)
    assert got.tolist() == [1.0, -2.0, 0.25, 0.5, -2.0]
    # frequency: minus penalty x count in the output only
    got = _logits_after(SamplingParams(frequency_penalty=0.5), logits, prompt, outputs)
    assert got.tolist() == [2.0, -1.0, -0.5, 0.5, -2.0]
    # presence: minus penalty once for any output occurrence
    got = _logits_after(SamplingParams(presence_penalty=0.5), logits, prompt, outputs)
    assert got.tolist() == [2.0, -1.0, 0.0, 0.5, -2.0]
    got = _logits_after(SamplingParams(logit_bias={4: 5.0}), logits, prompt, outputs)
    assert got.tolist() == [2.0, -1.0, 0.5, 1.0, 3.0]


def test_penalty_changes_generation(llm):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = _texts(llm.generate(PROMPTS[0], base))[0]
    penalised = _texts(llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0)))[0]
    if len(set(plain)) < len(plain):  # the plain run repeats something: the penalty must change it
        assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=21), "logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logit_bias={1: 200}), "logit_bias"),
        (dict(seed="x"), "seed"),
    ],
)
def test_invalid_values_name_their_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and field in str(info.value)


def test_token_ids_outside_the_vocabulary(llm):
    vocab = llm.engine.arch.vocab_size
    with pytest.raises(InvalidRequestError, match="stop_token_ids: token id"):
        llm.generate("hi", SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(InvalidRequestError, match="logit_bias: token id"):
        llm.generate("hi", SamplingParams(logit_bias={vocab + 5: 1.0}))


def test_top_k_candidates_path_equals_the_full_sort(monkeypatch):
    """With a top-k on every row only the top-k are ranked; the kept tokens and their
    logits are exactly those of sorting the whole vocabulary."""
    import kvserve.engine.sampler as sampler

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 3000, generator=gen) * 4
    top_k = torch.tensor([40] * 6 + [1, 2, 7, 40, 100, 999])
    top_p = torch.tensor([0.95, 0.5, 1.0, 0.99, 0.1, 0.9] * 2)
    min_p = torch.tensor([0.05, 0.0] * 6)
    fast = filter_logits(logits, top_k, top_p, min_p)
    monkeypatch.setattr(sampler, "_TOPK_LIMIT", 0)  # force the sort
    slow = filter_logits(logits, top_k, top_p, min_p)
    assert torch.equal(fast, slow)


def test_mixed_batch_processes_only_the_rows_that_need_it():
    """Plain greedy rows take the raw argmax, the others the whole pipeline: the same tokens
    and logprobs as processing every row."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 300, generator=gen) * 3).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.9, seed=4),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0, logit_bias={7: 50.0}),
    ]
    def requests():
        return [Request(str(i), [7, 8, 9], p) for i, p in enumerate(params)]
    mixed = Sampler()(logits.clone(), requests())
    whole = Sampler()._sample(logits.clone(), requests())
    assert mixed.token_ids == whole.token_ids and mixed.token_ids[5] == 7
    assert mixed.logprobs == whole.logprobs and mixed.sampled_logprobs == whole.sampled_logprobs
