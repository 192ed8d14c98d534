"""The shape of a decoder kvserve runs: everything the forward pass and the KV cache need.

One dataclass for every family (families/: Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3),
which differ in named options (QKV bias, per-head q/k RMSNorm, partial rotary, RoPE theta and
scaling, sliding windows, Gemma's norms, activation and soft-capping); read from an HF
`config.json` here (`read_hf_config`) or from GGUF metadata (`kvserve.model.gguf_metadata`), or named in `kvserve.arch_presets`. Torch-free:
the planner, the simulator and tools/make_model.py describe models with it too.

Reading a shape and running it are separate decisions. A `ModelArchitecture` can hold
any Llama-shaped decoder; `check_supported()` says whether the engine runs it, and the
readers call it unless told `require_supported=False` (the planner, which plans for
shapes the engine does not run). This module also owns the two counts both sides use:
`kv_bytes_per_position` (c_kv) and `llama_num_params` (P).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvserve.errors import ModelLoadError, UnsupportedModelError

from kvserve.families import SUPPORTED_ARCHITECTURES, family_of  # noqa: F401 (re-exported)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


# Read first, in this order, so a missing one is named the same way every time.
_REQUIRED_HF_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def kv_bytes_per_position(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_kv_element: float, scale_bytes: float = 0
) -> float:
    """c_kv = 2·L·N_kv·(H·p_kv + s) bytes (the 2 is K and V, every layer).

    An int p_kv (the engine's element size) gives an int; the planner passes fractional
    bytes too (0.5 for 4-bit KV). `scale_bytes` s: a quantized KV cache's scale per
    (position, KV head) beside the H elements (the engine's int8 KV: p_kv = 1, s = 4, an
    fp32 scale; KV_INT8_SCALE_BYTES); 0 for a float cache.
    """
    return 2 * num_layers * num_kv_heads * (head_dim * bytes_per_kv_element + scale_bytes)


# the engine's int8 KV cache keeps one fp32 scale per (position, KV head) beside each pool
KV_INT8_SCALE_BYTES = 4


def llama_layer_params(
    d_model: int, ffn_width: int, num_query_heads: int, num_kv_heads: int, head_dim: int, *,
    attention_bias: bool = False, qk_norm: bool = False, sandwich_norms: bool = False,
) -> int:
    """Parameters of one Llama decoder layer: Q/K/V/O, the gated MLP, two RMSNorms; with
    `attention_bias` (Qwen2) the Q, K and V biases, (N_q + 2·N_kv)·H (O has none); with
    `qk_norm` (Qwen3) the q and k RMSNorm weights, H each (shared by every head); with
    `sandwich_norms` (Gemma 3) two more RMSNorms, after attention and after the MLP."""
    attention = d_model * head_dim * (2 * num_query_heads + 2 * num_kv_heads)
    if attention_bias:
        attention += (num_query_heads + 2 * num_kv_heads) * head_dim
    if qk_norm:
        attention += 2 * head_dim
    return attention + 3 * d_model * ffn_width + (4 if sandwich_norms else 2) * d_model


def llama_num_params(
    num_layers: int, d_model: int, ffn_width: int, num_query_heads: int, num_kv_heads: int,
    head_dim: int, vocab_size: int, tied_embeddings: bool, *, attention_bias: bool = False, qk_norm: bool = False,
    sandwich_norms: bool = False,
) -> int:
    """P of a Llama-shaped decoder: embeddings (and an untied LM head), the layers
    (`llama_layer_params`), then the final norm. A GGUF can be counted exactly from its
    tensor shapes instead."""
    per_layer = llama_layer_params(
        d_model, ffn_width, num_query_heads, num_kv_heads, head_dim, attention_bias=attention_bias, qk_norm=qk_norm,
        sandwich_norms=sandwich_norms,
    )
    embeddings = vocab_size * d_model * (1 if tied_embeddings else 2)
    return num_layers * per_layer + embeddings + d_model


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE scaling, as transformers' rope_utils reads it (kvserve/model/layers.py
    computes the frequencies): `linear` divides every frequency by `factor`; `llama3` keeps,
    scales or blends frequency bands; `yarn` blends interpolated and extrapolated frequencies
    over the dimensions between `beta_fast` and `beta_slow` rotations and scales cos/sin by an
    attention factor; `dynamic` (NTK) is the unscaled RoPE up to the original context, which
    is as far as the engine serves such a model; `longrope` (Phi-3) divides each frequency by
    its `short_factor` or `long_factor` (the long ones where the engine serves more than the
    original context, as llama.cpp chooses by its context size) and scales cos/sin."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: frequency bands that keep, scale, or blend between the two
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only (transformers' defaults where a config leaves them out)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope only: a divisor per frequency (head_dim / 2 of them, of the rotated part)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ModelArchitecture:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # defaults as a config.json that leaves them out is read (from_hf_config)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Qwen3: an RMSNorm over each query and key head (one weight of H per projection) between
    # the QKV projection and RoPE
    qk_norm: bool = False
    # Phi-3/4: RoPE turns only the first rotary_dim = head_dim · this features of each head
    partial_rotary_factor: float = 1.0
    # Gemma 3: RMSNorm weights stored as w and applied as (offset + w); the embeddings scaled by
    # embedding_scale (√hidden); a norm after attention and after the MLP as well as before
    # ("sandwich"); the MLP's activation; attention scaled by query_pre_attn_scalar^-1/2; each
    # layer's kind ("sliding_attention" layers use rope_local_theta, the others rope_theta)
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    rope_scaling: RopeScaling = RopeScaling()
    sliding_window: int | None = None
    # Gemma 2: attention scores and the final logits soft-capped, x -> cap · tanh(x / cap)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # OLMoE (and OLMo 2): q and k each RMSNormed over the whole projection (all heads' features
    # at once, weights N_q·H and N_kv·H) rather than per head
    qk_norm_whole: bool = False
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a sparse layer's FFN is
    # num_experts SiLU experts of moe_intermediate_size, num_experts_per_tok chosen per token by a
    # router (softmax over all experts in fp32, the top k, renormalised to sum 1 where
    # norm_topk_prob); Qwen2-MoE adds a shared expert of shared_expert_intermediate_size, gated
    # by sigmoid(x·g). `dense_layers`: layers whose FFN is a dense one of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def check_supported(self) -> "ModelArchitecture":
        """This architecture, if the engine runs it; else UnsupportedModelError saying why."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {self.rope_scaling.rope_type!r}; "
                f"kvserve implements {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        return self

    @property
    def attention_scale(self) -> float:
        """The factor on q·k: query_pre_attn_scalar^-1/2 where the config names it, else head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_is_local(self, index: int) -> bool:
        """Layer `index` turns its queries and keys with the local RoPE base (Gemma 3's sliding layers)."""
        return self.rope_local_theta is not None and self.layer_window(index) is not None

    def layer_window(self, index: int) -> int | None:
        """The positions layer `index` attends to back from each query, its own included (query p
        sees keys p - W + 1 .. p, as transformers' sliding mask), or None for full attention: the
        `sliding_attention` layers of `layer_types` where the model lists kinds, else every layer
        of a model with a sliding window (Mistral v0.1)."""
        if self.sliding_window is None:
            return None
        if self.layer_types:
            return self.sliding_window if self.layer_types[index] == "sliding_attention" else None
        return self.sliding_window

    @property
    def qk_norm_per_head(self) -> bool:
        """Q and K RMSNormed head by head (Qwen3, Gemma 3): the rms_norm kernel's rows of H;
        OLMoE's norms over the whole projection are not."""
        return self.qk_norm and not self.qk_norm_whole

    def layer_is_sparse(self, index: int) -> bool:
        """Layer `index`'s FFN is routed experts (a mixture-of-experts model's sparse layer)."""
        return self.num_experts > 0 and index not in self.dense_layers

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.layer_is_sparse(i) for i in range(self.num_layers))

    def expert_params(self) -> int:
        """Parameters of one routed expert: gate, up and down of moe_intermediate_size."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's window (`layer_window`), in layer order."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def fused_layer_refusal(self) -> str | None:
        """None where the fused decode step (kernels/fused_decode.cpp) runs every layer as it is,
        else what it does not run. It runs Llama's layer and the options of it the other
        families name (per-head or whole-projection q/k norms, Gemma's norms after each branch,
        GeGLU, local RoPE tables, per-group KV, soft-capped attention scores, a sparse layer's
        experts for one token); scaled embeddings and final soft-capping sit outside its layers."""
        if self.hidden_act not in ("silu", "gelu_tanh"):
            return f"a {self.hidden_act} MLP"
        return None

    @property
    def rotary_dim(self) -> int:
        """Features of each q/k head that RoPE turns (the first ones); head_dim but for partial rotary."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def queries_per_kv_head(self) -> int:
        """g = N_q / N_kv: Query heads that share one KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_position(self, kv_element_bytes: float, scale_bytes: float = 0) -> float:
        """c_kv = 2 · L · N_kv · (H · p_kv + s) (K and V, every layer); an int for an int p_kv.
        `scale_bytes` s: a quantized cache's scale per (position, KV head), 0 for a float one."""
        return kv_bytes_per_position(self.num_layers, self.num_kv_heads, self.head_dim, kv_element_bytes, scale_bytes)

    def kv_int8_bytes_per_position(self) -> int:
        """c_kv of the engine's int8 KV cache: int8 elements and an fp32 scale per (position, KV head)."""
        return self.kv_bytes_per_position(1, KV_INT8_SCALE_BYTES)

    @property
    def decoder_layer_params(self) -> int:
        """Parameters of all decoder layers (what multiplies every token's activations); a
        sparse layer counts all its experts (`moe_params` splits them off)."""
        dense = self.num_layers * llama_layer_params(
            self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim,
            attention_bias=self.attention_bias, qk_norm=self.qk_norm, sandwich_norms=self.sandwich_norms,
        )
        return dense + self.num_sparse_layers * (self._sparse_ffn_params() - 3 * self.hidden_size * self.intermediate_size)

    def _sparse_ffn_params(self) -> int:
        """One sparse layer's FFN: the router (E·d), E experts, and the shared expert with its gate."""
        d = self.hidden_size
        shared = 3 * d * self.shared_expert_intermediate_size + d if self.shared_expert_intermediate_size else 0
        return self.num_experts * d + self.num_experts * self.expert_params() + shared

    @property
    def routed_expert_params(self) -> int:
        """Parameters in routed experts, every sparse layer: what a decode step reads only in part."""
        return self.num_sparse_layers * self.num_experts * self.expert_params()

    @property
    def num_params(self) -> int:
        """P counted from the shape (`llama_num_params`), QKV bias included where there is one;
        a mixture of experts with every expert (the weights held)."""
        dense = llama_num_params(
            self.num_layers, self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
            self.head_dim, self.vocab_size, tied_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias, qk_norm=self.qk_norm, sandwich_norms=self.sandwich_norms,
        )
        return dense + self.decoder_layer_params - self.num_layers * llama_layer_params(
            self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim,
            attention_bias=self.attention_bias, qk_norm=self.qk_norm, sandwich_norms=self.sandwich_norms,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelArchitecture":
        data = dict(data)
        scaling = dict(data.get("rope_scaling") or {})
        for key in ("short_factor", "long_factor"):  # JSON gives lists; the frozen shape holds tuples
            if scaling.get(key) is not None:
                scaling[key] = tuple(scaling[key])
        data["rope_scaling"] = RopeScaling(**scaling)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids") or ())
        data["layer_types"] = tuple(data.get("layer_types") or ())
        data["dense_layers"] = tuple(data.get("dense_layers") or ())
        return cls(**data).check_supported()

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, require_supported: bool = True) -> "ModelArchitecture":
        """The shape a decoder's `config.json` describes; KeyError names the first missing field.

        With `require_supported` (the engine) a model the engine cannot run raises
        UnsupportedModelError; without it (the planner) any Llama-shaped config is read.
        """
        model_type = config.get("model_type", "?")
        if require_supported:
            if model_type not in SUPPORTED_ARCHITECTURES:
                archs = config.get("architectures") or []
                raise UnsupportedModelError(
                    f"unsupported architecture {model_type!r} ({', '.join(archs) or 'no architectures listed'}); "
                    f"kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            if config.get("mlp_bias"):
                raise UnsupportedModelError("unsupported: mlp_bias=true")
        for key in _REQUIRED_HF_FIELDS:
            if key not in config:
                raise KeyError(key)
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # the family's own fields (families/): bias, q/k norms, windows, Gemma's options;
        # a config of a type no family reads (the planner's) is read as a Llama
        options = family_of(model_type).hf_options(config, model_type) if model_type in SUPPORTED_ARCHITECTURES else {}
        options.setdefault("attention_bias", bool(config.get("attention_bias", False)))
        arch = cls(
            architecture=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(config),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            partial_rotary_factor=float(
                config.get("partial_rotary_factor") or _rope_params(config).get("partial_rotary_factor") or 1.0
            ),
            rope_scaling=_rope_scaling(config),
            **options,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        return arch.check_supported() if require_supported else arch


def read_hf_config(path: str | Path, *, require_supported: bool = True) -> ModelArchitecture:
    """The architecture of a Hugging Face model's `config.json` (the file, or the directory
    holding it): the one reader of HF shapes, for the engine's loader and the planner. Without
    `require_supported` (the planner) a multimodal config's decoder (`text_config`) is read."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: missing config.json" if path.is_dir() else f"{path}: no such file")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    if not require_supported:
        config = config.get("text_config", config)
    try:
        return ModelArchitecture.from_hf_config(config, require_supported=require_supported)
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: missing field {exc.args[0]!r}") from exc


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters`; older configs `rope_scaling` + `rope_theta`;
    # Gemma 3 one set per layer kind, the global layers' is the model's
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    return params if isinstance(params, dict) else {}


def _rope_theta(config: dict[str, Any]) -> float:
    return float(_rope_params(config).get("rope_theta") or config.get("rope_theta") or 10000.0)


def _rope_scaling(config: dict[str, Any]) -> RopeScaling:
    params = _rope_params(config)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in params.items() if k in fields and v is not None}
    kwargs["rope_type"] = rope_type
    for key in ("short_factor", "long_factor"):
        if key in kwargs:
            kwargs[key] = tuple(float(v) for v in kwargs[key])
    if rope_type in ("yarn", "dynamic", "longrope") and "original_max_position_embeddings" not in kwargs:
        # transformers' standardize_rope_params: Phi-3 names it beside the scaling, others use
        # the config's own context as the original one
        kwargs["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings", config.get("max_position_embeddings", 4096)
        )
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:  # as transformers infers it
        kwargs["factor"] = config.get("max_position_embeddings", 4096) / kwargs["original_max_position_embeddings"]
    return RopeScaling(**kwargs)
