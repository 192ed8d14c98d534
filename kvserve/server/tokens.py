"""POST /tokenize and /detokenize (vLLM's shapes): the model's tokenizer over HTTP.
Both run in a worker thread (api.py), never on the event loop."""

from __future__ import annotations

from kvserve.errors import InvalidRequestError
from kvserve.server.chat import conversation
from kvserve.server.context import ServingContext
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.server.tools import template_reads_tools


def tokenize(ctx: ServingContext, request: TokenizeRequest) -> dict:
    ctx.check_model(request.model)
    tokenizer = ctx.engine.tokenizer
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
    if request.messages is not None:
        # tool history rendered as the chat route renders it for this template
        messages = conversation(request.messages, native_tools=template_reads_tools(tokenizer.chat_template))
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }


def detokenize(ctx: ServingContext, request: DetokenizeRequest) -> dict:
    ctx.check_model(request.model)
    vocab_size = ctx.engine.engine.arch.vocab_size
    for t in request.tokens:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"token id {t} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(request.tokens, skip_special_tokens=False)}
