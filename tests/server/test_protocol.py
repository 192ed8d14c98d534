"""Request → SamplingParams without a server: OpenAI's defaults, vLLM's extras, the room
left in the context, and the field each error names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.errors import InvalidRequestError, PromptTooLongError
from kvserve.server.errors import from_validation_error
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.sampling import fit_max_tokens, sampling_params


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_openai_defaults_not_greedy():
    params = sampling_params(_completion(), logprobs=None, max_tokens=None)
    assert (params.temperature, params.top_p, params.n, params.max_tokens) == (1.0, 1.0, 1, None)


def test_fields_and_vllm_extras_reach_sampling_params():
    request = _completion(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop="##", presence_penalty=0.5,
        frequency_penalty=0.25, repetition_penalty=1.1, logit_bias={"7": -5.0}, ignore_eos=True, min_tokens=2,
        stop_token_ids=[9], include_stop_str_in_output=True, skip_special_tokens=False, user="someone",
    )  # fmt: skip
    p = sampling_params(request, logprobs=2, max_tokens=10)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (2, 0.5, 0.9, 5, 0.1, 3)
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.logprobs, p.max_tokens, p.min_tokens) == (["##"], [9], {7: -5.0}, 2, 10, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert p.ignore_eos and p.include_stop_str_in_output and not p.skip_special_tokens


def test_absent_max_tokens_takes_the_room_left():
    params = sampling_params(_completion(), logprobs=None, max_tokens=None)
    assert fit_max_tokens(params, num_prompt_tokens=100, max_model_len=256).max_tokens == 156


def test_a_full_context_leaves_no_room():
    params = sampling_params(_completion(), logprobs=None, max_tokens=None)
    with pytest.raises(PromptTooLongError, match="leaves no room") as info:
        fit_max_tokens(params, num_prompt_tokens=256, max_model_len=256, prompt_field="messages")
    assert info.value.param == "messages"


def test_max_tokens_that_cannot_fit_names_its_field():
    params = sampling_params(_completion(), logprobs=None, max_tokens=200)
    with pytest.raises(PromptTooLongError, match=r"maximum context length is 256 tokens.*300 tokens") as info:
        fit_max_tokens(params, 100, 256, max_tokens_field="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"


def test_range_error_names_max_completion_tokens():
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(request, logprobs=None, max_tokens=0, max_tokens_field="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    "body, param",
    [
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": "x", "stop": [1]}', "stop"),
        ('{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
    ],
)
def test_validation_error_param_leaves_out_union_members(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(body)
    assert from_validation_error(info.value).param == param


def test_unknown_fields_are_ignored():
    assert _completion(some_future_field=1).prompt == "x"


def test_max_tokens_unset_stays_unset_for_the_server_default():
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

    # completions.py turns an unset max_tokens into the server's default, else OpenAI's 16
    assert CompletionRequest.model_validate({"prompt": "hi"}).max_tokens is None
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.max_tokens is None and chat.max_completion_tokens is None
