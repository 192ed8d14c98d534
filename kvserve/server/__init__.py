"""The OpenAI-compatible HTTP server: `kvserve serve`.

cli.py (flags) → runner.py (process: engine thread, uvicorn, signals) → api.py (app:
routes, middleware, error handlers) → completions.py / chat.py / tokens.py (endpoints),
built on protocol.py (wire format), sampling.py (request → SamplingParams),
lifecycle.py (ids, disconnects, SSE), logprobs.py, metrics.py, errors.py, config.py.
"""
