"""Each bad input gets its status and an OpenAI error body naming the field; the API key
guards every route but the probes and the playground's pages; oversized bodies get 413
whether or not they declare their length; bodies must be JSON."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, body: a dict sent as JSON or a str sent raw, status, param, code)
BAD_INPUTS = {
    "malformed JSON": (COMPLETIONS, '{"prompt": "x",', 400, None, "invalid_json"),
    "body not an object": (COMPLETIONS, "[1, 2]", 400, None, None),
    "missing prompt": (COMPLETIONS, {"max_tokens": 3}, 400, "prompt", None),
    "string for a number": (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    "string for an integer": (COMPLETIONS, {"prompt": "x", "n": "2"}, 400, "n", None),
    "number for a prompt": (COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
    "number for message content": (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    "temperature below 0": (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    "top_p above 1": (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    "n of 0": (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", None),
    "logprobs above 20": (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    "top_logprobs above 20": (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    "max_tokens of 0": (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    "max_completion_tokens of 0": (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    "stop token outside the vocabulary": (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
    "logit_bias key not a token id": (COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    "unknown model": (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    "unknown model (chat)": (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model", "model_not_found"),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    "empty token prompt": (COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    "no messages": (CHAT, {"messages": []}, 400, "messages", None),
    "too many prompts": (COMPLETIONS, {"prompt": ["a"] * 257}, 400, "prompt", None),
    "prompt over max_model_len": (COMPLETIONS, {"prompt": "hello " * 300}, 400, "prompt", "context_length_exceeded"),
    "messages over max_model_len": (CHAT, {"messages": [{"role": "user", "content": "hello " * 300}]}, 400, "messages", "context_length_exceeded"),
    "max_tokens that cannot fit": (COMPLETIONS, {"prompt": "x", "max_tokens": 300}, 400, "max_tokens", "context_length_exceeded"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input(http, case):
    path, body, status, param, code = BAD_INPUTS[case]
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_max_tokens_message_names_the_numbers(http):
    error = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 300}).json()["error"]
    assert "maximum context length is 256 tokens" in error["message"] and "300 in the completion" in error["message"]


def test_body_over_the_limit_is_413(http):
    big = json.dumps({"prompt": "x" * 70_000})
    response = http.post(COMPLETIONS, content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():  # no Content-Length: the server must count what arrives
        yield b'{"prompt": "'
        for _ in range(70):
            yield b"x" * 1000
        yield b'"}'

    response = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}], ids=["missing", "wrong", "not bearer"])
def test_routes_need_the_api_key(server, headers):
    keyed = (("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"))
    for method, path in keyed:
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "x"})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


def test_probes_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").status_code == 200


def test_the_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200, scheme


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_post_bodies_must_be_json(http, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post(COMPLETIONS, content=json.dumps({"prompt": "x", "max_tokens": 1}), headers=headers)
    if content_type is None:  # httpx sends none for raw content
        assert "content-type" not in response.request.headers
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    ok = http.post(COMPLETIONS, content=json.dumps({"prompt": "x", "max_tokens": 1}), headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_unknown_route_has_an_error_body(http):
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["message"]
