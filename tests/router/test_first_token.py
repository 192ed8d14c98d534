"""router/first_token.py: the first chunks built from a prefill answer, and the decode
stream with that token taken out (text, logprobs entry, role chunk), whatever way its bytes
are split; the rules for when a stream may start from the prefill answer."""

from __future__ import annotations

import json

import pytest

from kvserve.router.first_token import FirstTokenSplice, early_eligible, first_chunks, first_text_is_whole

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _events(data: bytes) -> list:
    out = []
    for event in data.decode().split("\n\n"):
        if event:
            assert event.startswith("data: ")
            out.append(event[6:] if event == "data: [DONE]" else json.loads(event[6:]))
    return out


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def _splice_all(splice: FirstTokenSplice, data: bytes, step: int) -> bytes:
    out = b"".join(splice.feed(data[i : i + step]) for i in range(0, len(data), step))
    return out + splice.flush()


PREFILL_CMPL = {"id": "cmpl-p", "created": 7, "model": "m", "choices": [{"index": 0, "text": " The", "finish_reason": "length",
                "logprobs": {"tokens": [" The"], "token_logprobs": [-0.5], "top_logprobs": [{" The": -0.5}], "text_offset": [0]}}]}  # fmt: skip


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_a_completion_stream_loses_exactly_its_first_token(step):
    head = _events(first_chunks(CMPL, PREFILL_CMPL))
    assert head == [{"id": "cmpl-p", "created": 7, "model": "m", "object": "text_completion",
                     "choices": [{"index": 0, "text": " The", "logprobs": PREFILL_CMPL["choices"][0]["logprobs"], "finish_reason": None}]}]  # fmt: skip
    lp = {"tokens": [" The", " sky"], "token_logprobs": [-0.5, -1.0], "top_logprobs": [{" The": -0.5}, {" sky": -1.0}],
          "text_offset": [0, 4]}  # fmt: skip
    decode = _sse(
        {"id": "cmpl-d", "created": 9, "choices": [{"index": 0, "text": " The sky", "logprobs": lp, "finish_reason": None}]},
        {"id": "cmpl-d", "created": 9, "choices": [{"index": 0, "text": " is", "logprobs": None, "finish_reason": "length"}]},
        {"id": "cmpl-d", "created": 9, "choices": [], "usage": {"completion_tokens": 3}},
        b"[DONE]",
    )
    out = _events(_splice_all(FirstTokenSplice(CMPL, PREFILL_CMPL), decode, step))
    assert [c["id"] for c in out[:-1]] == ["cmpl-p"] * 3 and {c["created"] for c in out[:-1]} == {7}
    assert out[0]["choices"][0]["text"] == " sky"
    assert out[0]["choices"][0]["logprobs"] == {"tokens": [" sky"], "token_logprobs": [-1.0], "top_logprobs": [{" sky": -1.0}],
                                                "text_offset": [4]}  # fmt: skip
    assert out[1]["choices"][0]["text"] == " is" and out[1]["choices"][0]["finish_reason"] == "length"
    assert out[2]["usage"] == {"completion_tokens": 3} and out[3] == "[DONE]"


def test_a_chat_stream_loses_its_role_chunk_and_first_token():
    answer = {"id": "chat-p", "created": 7, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "logprobs": None}]}  # fmt: skip
    head = _events(first_chunks(CHAT, answer))
    assert [c["choices"][0]["delta"] for c in head] == [{"role": "assistant", "content": ""}, {"content": "Hi"}]
    decode = _sse(
        {"id": "chat-d", "created": 9, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "chat-d", "created": 9, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},  # the first token alone
        {"id": "chat-d", "created": 9, "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]},
        {"error": {"message": "late failure", "code": "x"}},
        b"[DONE]",
    )
    out = _events(_splice_all(FirstTokenSplice(CHAT, answer), decode, 5))
    assert out[0]["choices"][0]["delta"] == {"content": " there"} and out[0]["id"] == "chat-p"
    assert out[1] == {"error": {"message": "late failure", "code": "x"}} and out[2] == "[DONE]"


def test_a_first_token_that_also_finishes_keeps_the_finish():
    answer = {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "text": "!", "logprobs": None}]}
    decode = _sse({"id": "d", "created": 2, "choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}, b"[DONE]")
    out = _events(_splice_all(FirstTokenSplice(CMPL, answer), decode, 3))
    assert out[0]["choices"] == [{"index": 0, "text": "", "finish_reason": "stop"}] and out[1] == "[DONE]"


def test_when_a_stream_may_start_from_the_prefill_answer():
    assert early_eligible(CMPL, {"stream": True}) and early_eligible(CHAT, {"stream": True, "tools": [{}], "tool_choice": "none"})
    assert not early_eligible(CMPL, {"stream": False})
    assert not early_eligible(CMPL, {"stream": True, "stop": ["\n"]})  # a stop string may hold the first token's text back
    assert not early_eligible(CMPL, {"stream": True, "echo": True})
    assert not early_eligible(CHAT, {"stream": True, "tools": [{"type": "function"}]})  # the parser must see the text from its start
    assert first_text_is_whole(" The") and not first_text_is_whole("\ufffd")
