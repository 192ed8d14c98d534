"""Every stop condition: EOS (all of the model's), stop_token_ids, stop strings split across
tokens, max_tokens, min_tokens, ignore_eos, and whether the stop string is kept."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)


@pytest.fixture(scope="module")
def greedy(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    return out


def _eos(llm):
    return llm.tokenizer.eos_token_ids[0]


def test_eos_stops(llm):
    eos = _eos(llm)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100}))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == ""  # special tokens are not rendered


def test_ignore_eos_runs_to_max_tokens(llm):
    eos = _eos(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={eos: 100})
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == [eos] * 6 and out.finish_reason == "length"


def test_min_tokens_holds_back_eos(llm):
    eos = _eos(llm)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100}))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"


def test_stop_token_ids(llm, greedy):
    target = greedy.token_ids[3]
    first = greedy.token_ids.index(target)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_max_tokens(llm, greedy):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:7] and out.finish_reason == "length"


def _split_stop(llm, greedy) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside a later one."""
    tok = llm.tokenizer
    pieces = [tok.decode([t]) for t in greedy.token_ids]
    offsets, pos = [], 0
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    for i in range(2, len(pieces) - 2):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1:
            start = offsets[i] + 1
            stop = greedy.text[start : offsets[i + 1] + len(pieces[i + 1])]
            if greedy.text.find(stop) == start and stop.strip():
                return stop, start
    pytest.skip("no suitable token boundary in this output")


def test_stop_string_across_tokens(llm, greedy):
    stop, start = _split_stop(llm, greedy)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "never-there"]))[0].outputs[0]
    assert out.text == greedy.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_string_kept_when_asked(llm, greedy):
    stop, start = _split_stop(llm, greedy)
    params = SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.text == greedy.text[: start + len(stop)]


def test_streamed_text_never_shows_a_stop_string(llm, greedy):
    stop, start = _split_stop(llm, greedy)
    deltas = []
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=stop), on_output=lambda o: deltas.append(o.outputs[0].delta_text))
    assert "".join(deltas) == greedy.text[:start]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_default_model_has_all_its_end_tokens():
    """SmolLM2's GGUF names <|im_end|> as EOS; the chat turn ends on it."""
    from kvserve.model.loader import load_model

    loaded = load_model(None)
    assert 2 in loaded.tokenizer.eos_token_ids  # <|im_end|>
    assert loaded.tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]


def test_tokenizer_fast_decode_equals_the_transformers_decode(llm):
    """The detokenizer's direct call into the Rust tokenizer gives transformers' text exactly."""
    import random

    tok = llm.tokenizer
    assert tok._fast_decode is not None  # the tiny models' tokenizers are fast ones
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 9))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)
