"""What a request's unset sampling fields become: the server's defaults.

OpenAI's API defaults (temperature 1.0, top_p 1.0, nothing else) suit models whose
distribution is sharp; on a small model they give gibberish, and llama.cpp's server applies
its own sampler defaults instead. kvserve settles each field once at start-up, in this
order, and reports where each came from:

1. a `kvserve serve` flag (`--temperature`, `--top-p`, …);
2. with `--generation-config auto` (the default), the model's own settings: HF
   `generation_config.json`, GGUF `general.sampling.*`;
3. llama.cpp's defaults under `auto` (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05),
   OpenAI's neutral ones under `none`.

A field the request sets always wins. `max_tokens` keeps each endpoint's own rule unless
the model or a flag sets it (completions: 16; chat: the room the context leaves).
"""

from __future__ import annotations

import dataclasses

from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "none")

# llama.cpp's common_params_sampling defaults (common/common.h), which llama-server applies
# to a request that leaves them unset; its penalties default to off
LLAMA_CPP_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# the OpenAI API's own defaults: no filtering, temperature 1
OPENAI_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
FIELDS = tuple(OPENAI_DEFAULTS) + ("max_tokens",)


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    values: dict[str, float | int]  # every field of OPENAI_DEFAULTS, plus max_tokens when set
    sources: dict[str, str]  # field -> "flag" | "model" | "llama.cpp" | "openai"

    def get(self, field: str, requested):
        return self.values.get(field) if requested is None else requested

    def describe(self) -> str:
        parts = [f"{field} {self.values[field]:g} ({self.sources[field]})" for field in FIELDS if field in self.values]
        return "sampling defaults for unset request fields: " + ", ".join(parts)


def resolve_sampling_defaults(
    mode: str, model_config: dict[str, float | int], overrides: dict[str, float | int | None]
) -> SamplingDefaults:
    """`mode`: --generation-config; `model_config`: the model's own settings
    (kvserve/model/generation_config.py); `overrides`: the per-field flags (None = unset)."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ConfigError("generation_config", f"must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ConfigError("sampling defaults", f"unknown field(s) {', '.join(unknown)}")
    values: dict[str, float | int] = {}
    sources: dict[str, str] = {}
    layers = [("openai", OPENAI_DEFAULTS)]
    if mode == "auto":
        layers += [("llama.cpp", LLAMA_CPP_DEFAULTS), ("model", {k: v for k, v in model_config.items() if k in FIELDS})]
    layers.append(("flag", {k: v for k, v in overrides.items() if v is not None}))
    for source, layer in layers:
        for field, value in layer.items():
            values[field] = value
            sources[field] = source
    try:  # the same range checks a request gets, once, naming the field
        SamplingParams(**{k: v for k, v in values.items()})
    except InvalidRequestError as exc:
        raise ConfigError(f"default {exc.param} (from {sources.get(exc.param, '?')})", str(exc)) from None
    return SamplingDefaults(values, sources)
