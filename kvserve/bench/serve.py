"""`kvserve bench serve`: a sweep of request rates against one OpenAI-compatible server.

Each rate gets its own random prompts (a fresh seed), so no rate profits from the
prefix cache another one filled. A few sequential warm-up requests go first and are not
counted; if every one of them fails, the run stops with the server's error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvserve.bench.errors import BenchError
from kvserve.bench.workload import build_workload
from kvserve.loadgen.load import auth_headers, load_metrics, run_at_rate
from kvserve.loadgen.stats import SLO

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "number group problem fact river stone light music garden window paper city story water table").split()


def api_base(url: str) -> str:
    """http://host:port, http://host:port/ or http://host:port/v1 → http://host:port/v1"""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchError(f"--url must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def discover_model(base: str, timeout_s: float, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    try:
        response = httpx.get(base + "/models", timeout=timeout_s, headers=auth_headers(api_key))
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise BenchError(f"cannot list models at {base}/models ({type(exc).__name__}: {exc}); is the server up? "
                         "or name the model with --model-name") from None
    if not models:
        raise BenchError(f"{base}/models lists no model; name one with --model-name")
    return str(models[0]["id"])


def text_prompt(num_words: int, seed: int) -> str:
    """Random common words: about one token each in most BPE vocabularies (usage gives the exact count)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(_WORDS, size=num_words).tolist())


@dataclasses.dataclass
class ServeSettings:
    url: str
    model_name: str | None = None
    api_key: str | None = None
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    prompt_format: str = "ids"  # ids: exact lengths; text: random words, for servers that take no id lists
    vocab_size: int = 32000
    warmup_requests: int = 2
    timeout_s: float = 600.0
    seed: int = 0
    slo: SLO = SLO()
    progress: bool = True


def _prompts(settings: ServeSettings, num: int, input_len: int, output_len: int, seed: int):
    workload = build_workload(num, input_len, output_len, settings.vocab_size, seed=seed, range_ratio=settings.range_ratio)
    lens = [len(p) for p in workload.prompts]
    if settings.prompt_format == "text":
        return [text_prompt(n, seed * 100_003 + i) for i, n in enumerate(lens)], lens, workload.output_lens
    return workload.prompts, lens, workload.output_lens


def rate_label(rate: float) -> str | float:
    """JSON has no infinity: an unlimited rate is written "inf"."""
    return "inf" if math.isinf(rate) else rate


def run_serve(settings: ServeSettings) -> dict[str, Any]:
    base = api_base(settings.url)
    model = settings.model_name or discover_model(base, min(settings.timeout_s, 30.0), settings.api_key)
    common = dict(burstiness=settings.burstiness, timeout_s=settings.timeout_s, progress=settings.progress,
                  api_key=settings.api_key)

    if settings.warmup_requests:
        prompts, lens, outs = _prompts(settings, settings.warmup_requests, settings.input_len, min(settings.output_len, 8), seed=10_000 + settings.seed)
        records, _ = run_at_rate(base, model, prompts, lens, outs, rate=math.inf, max_concurrency=1, seed=settings.seed, **{**common, "progress": False})
        if not any(r.ok for r in records):
            hint = " (if the server takes no token-id prompts, try --prompt-format text)" if settings.prompt_format == "ids" else ""
            raise BenchError(f"every warm-up request to {base}/completions failed: {records[0].error}{hint}")

    sweep = []
    for index, rate in enumerate(settings.request_rates):
        prompts, lens, outs = _prompts(settings, settings.num_prompts, settings.input_len, settings.output_len, seed=settings.seed + index)
        records, duration_s = run_at_rate(base, model, prompts, lens, outs, rate=rate, max_concurrency=settings.max_concurrency,
                                          seed=settings.seed + index, **common)
        sweep.append({
            "request_rate": rate_label(rate),
            "burstiness": settings.burstiness,
            "max_concurrency": settings.max_concurrency,
            **load_metrics(records, duration_s, settings.slo),
        })
    return {
        "url": base,
        "model": model,
        "workload": {"num_prompts": settings.num_prompts, "input_len": settings.input_len, "output_len": settings.output_len,
                     "range_ratio": settings.range_ratio, "prompt_format": settings.prompt_format},
        "slo_ms": {k.replace("_s", "_ms"): None if v is None else v * 1e3 for k, v in settings.slo.to_dict().items()},
        "sweep": sweep,
    }
