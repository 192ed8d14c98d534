"""Random-weight models of real shapes, for benchmarks and tests: `python -m tools.make_model`.

A benchmark of a 1B or 8B model needs its shapes and its bytes, not its training. This
writes a model of a named shape (the shared presets, `kvserve.arch_presets`) with random
weights and the SmolLM2 vocabulary (the tokenizer metadata of the default model's GGUF,
copied field by field, so the engine's tokenizer, chat template and stop tokens work), as

- a GGUF (`gguf.GGUFWriter`, arch `llama`, `qwen3`, `gemma2` or `gemma3` as llama.cpp names them) in
  a float type (`f16`, `bf16`) or a block quantization (`q8_0`, `q4_0`, `q4_1`, `q4_k`,
  `q5_k`, `q6_k`, `q4_k_m`), or
- a Hugging Face directory (`hf-bf16`; Llama and Qwen3 shapes): config.json,
  generation_config.json, the tokenizer files, and bf16 safetensors in shards of at most 2 GB.

    python -m tools.make_model --shape llama-3.2-1b --format q4_0 --out /models/llama-1b-q4_0.gguf

It lives outside the package: kvserve serves and benchmarks real models; these files only
reproduce the benchmark rows of BENCHMARKS.md and feed the tests (tests/tools).

Nothing holds the whole model: tensor infos are written first, then each tensor's data
as it is made (the 8B shape is 16 GB in bf16); a tensor is built in row chunks. Float
weights are normal with std 0.02 (norm weights 1.0); quantized ones are random blocks
(quant_blocks.py).

`q8_0`, `q4_0`, `q4_1`, `q4_k`, `q5_k`, `q6_k` are *pure*: every 2-D weight in that type
(as `llama-quantize --pure`; llama.cpp's non-pure ftypes would put the LM head in Q6_K).
`q4_k_m` follows llama.cpp's Q4_K_M recipe (`llama_tensor_get_type`):

- `output.weight`, or `token_embd.weight` when the embeddings are tied: Q6_K;
- `attn_v.weight` and `ffn_down.weight`: Q6_K in the layers `use_more_bits` picks (the
  first and last eighth, and every third layer between), Q4_K elsewhere;
- every other 2-D weight (untied `token_embd` included): Q4_K; norms F32.

A row length that is not a multiple of 256 cannot hold K-quant super-blocks; such a
tensor falls back as llama.cpp's does (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0). Only the
smollm2-135m shape (hidden 576) meets this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from kvserve.errors import ConfigError
from kvserve.arch import ModelArchitecture
from kvserve.arch_presets import PRESETS
from kvserve.families import HF_TO_GGUF_ARCH
from tools.quant_blocks import BLOCK_MAKERS, WEIGHT_STD

VOCAB_SIZE = 49152  # the default model's tokenizer, which every file carries (checked against its GGUF)
MAX_SHARD_BYTES = 2 * 10**9  # hf-bf16 safetensors shards
_CHUNK_ELEMENTS = 1 << 24  # a tensor is made this many weights at a time


# the shared presets, with the vocabulary of the tokenizer the files carry
SHAPES = {name: dataclasses.replace(arch, vocab_size=VOCAB_SIZE) for name, arch in PRESETS.items()}

GGUF_FORMATS = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k_m", "q4_k", "q5_k", "q6_k")
FORMATS = ("hf-bf16", *GGUF_FORMATS)

# ---- which type each tensor gets -----------------------------------------------------------


def _gguf_arch(shape: ModelArchitecture) -> str:
    """The architecture's name in llama.cpp (its metadata prefix): Mixtral is written as `llama`."""
    return "llama" if shape.architecture == "mixtral" else HF_TO_GGUF_ARCH[shape.architecture]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the *_M recipes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fallback(qtype, row_length: int):
    """llama.cpp's replacement for a K-quant whose rows are not whole super-blocks."""
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) and row_length % 256:
        return {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}[qtype]
    return qtype


def tensor_type(fmt: str, name: str, shape: ModelArchitecture, row_length: int):
    """The GGML type of tensor `name` (GGUF naming) in format `fmt`."""
    if name.endswith(("norm.weight", "ffn_gate_inp.weight")) or name == "rope_freqs.weight":  # norms, the MoE router
        return T.F32
    base = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1,
            "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q4_k_m": T.Q4_K}[fmt]
    if fmt == "q4_k_m":
        if name == "output.weight" or (name == "token_embd.weight" and shape.tie_word_embeddings):
            base = T.Q6_K
        elif name.endswith(("attn_v.weight", "ffn_down.weight")):
            layer = int(name.split(".")[1])
            if use_more_bits(layer, shape.num_layers):
                base = T.Q6_K
    return _fallback(base, row_length)


_FILE_TYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q4_k_m": 15, "q4_k": 14, "q5_k": 16, "q6_k": 18}


def _tensors(s: ModelArchitecture) -> list[tuple[str, str | None, tuple[int, ...]]]:
    """(GGUF name, HF name or None, shape [rows, row length]) of every tensor, in file order:
    one table, so the two checkpoints of a shape hold the same tensors."""
    D, F, q, kv = s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    out: list[tuple[str, str | None, tuple[int, ...]]] = []
    if s.rope_scaling.rope_type == "llama3":  # llama.cpp's converter stores the factors; HF computes them
        out.append(("rope_freqs.weight", None, (s.head_dim // 2,)))
    out.append(("token_embd.weight", "model.embed_tokens.weight", (s.vocab_size, D)))
    layer = [("attn_norm", "input_layernorm", (D,)), ("attn_q", "self_attn.q_proj", (q, D)),
             ("attn_k", "self_attn.k_proj", (kv, D)), ("attn_v", "self_attn.v_proj", (kv, D)),
             ("attn_output", "self_attn.o_proj", (D, q)), ("ffn_norm", "post_attention_layernorm", (D,)),
             ("ffn_gate", "mlp.gate_proj", (F, D)), ("ffn_up", "mlp.up_proj", (F, D)), ("ffn_down", "mlp.down_proj", (D, F))]  # fmt: skip
    if s.qk_norm_whole:  # OLMoE: one RMSNorm over the whole Q projection, one over K
        layer[4:4] = [("attn_q_norm", "self_attn.q_norm", (q,)), ("attn_k_norm", "self_attn.k_norm", (kv,))]
    elif s.qk_norm:  # Qwen3, Gemma 3: one RMSNorm weight of head_dim for the q heads, one for the k heads
        layer[4:4] = [("attn_q_norm", "self_attn.q_norm", (s.head_dim,)), ("attn_k_norm", "self_attn.k_norm", (s.head_dim,))]
    if s.num_experts:  # every layer sparse: the router and each projection's experts stacked [E, rows, row length]
        E, Fe = s.num_experts, s.moe_intermediate_size
        at = [g for g, _, _ in layer].index("ffn_gate")
        layer[at:] = [("ffn_gate_inp", "mlp.gate", (E, D)), ("ffn_gate_exps", None, (E, Fe, D)),
                      ("ffn_up_exps", None, (E, Fe, D)), ("ffn_down_exps", None, (E, D, Fe))]  # fmt: skip
    if s.sandwich_norms:  # Gemma 2 and 3: a norm after each branch; ffn_norm is its pre-feedforward one
        at = [g for g, _, _ in layer].index("ffn_norm")
        layer[at] = ("ffn_norm", "pre_feedforward_layernorm", (D,))
        layer.insert(at, ("post_attention_norm", "post_attention_layernorm", (D,)))
        layer.append(("post_ffw_norm", "post_feedforward_layernorm", (D,)))
    for i in range(s.num_layers):
        out += [(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", shape) for g, h, shape in layer]
    out.append(("output_norm.weight", "model.norm.weight", (D,)))
    if not s.tie_word_embeddings:
        out.append(("output.weight", "lm_head.weight", (s.vocab_size, D)))
    return out


def gguf_tensors(shape: ModelArchitecture) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, row length]) of every tensor, in file order."""
    return [(g, t) for g, _, t in _tensors(shape)]


def hf_tensors(shape: ModelArchitecture) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of the safetensors checkpoint, in file order."""
    return [(h, t) for _, h, t in _tensors(shape) if h is not None]


def llama3_rope_factors(shape: ModelArchitecture) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for llama3 RoPE scaling: the
    divisor of each inverse frequency."""
    r = shape.rope_scaling
    factor, low, high, old_ctx = r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0,
                   np.where(wavelen > old_ctx / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


# ---- one tensor's data ----------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    """A generator per tensor, so a tensor's values do not depend on which were made before it."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _row_chunks(rows: int, row_length: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // row_length)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _float_rows(rng: np.random.Generator, n_rows: int, row_length: int) -> np.ndarray:
    x = rng.standard_normal((n_rows, row_length), dtype=np.float32)
    x *= WEIGHT_STD
    return x


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns (uint16), rounding to nearest even (finite inputs)."""
    u = x.view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)


def tensor_data(name: str, shape: tuple[int, ...], qtype, model_shape: ModelArchitecture, seed: int) -> np.ndarray:
    """The bytes of one tensor as the array GGUFWriter writes: F32 norms (1.0) and RoPE
    factors, F16 / BF16 (uint16 bits) rows, or quantized blocks [rows, row bytes] uint8."""
    if name == "rope_freqs.weight":
        return llama3_rope_factors(model_shape)
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    if len(shape) == 3:  # a stack of experts: its rows one after another
        flat = tensor_data(name, (shape[0] * shape[1], shape[2]), qtype, model_shape, seed)
        return flat.reshape(shape[0], shape[1], -1)
    rows, row_length = shape
    rng = _rng(seed, name)
    if qtype in (T.F16, T.BF16, T.F32):
        out = np.empty(shape, dtype={T.F16: np.float16, T.BF16: np.uint16, T.F32: np.float32}[qtype])
        for a, b in _row_chunks(rows, row_length):
            x = _float_rows(rng, b - a, row_length)
            out[a:b] = _to_bf16_bits(x) if qtype == T.BF16 else x
        return out
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks_per_row = row_length // block
    make = BLOCK_MAKERS[qtype]
    out = np.empty((rows, blocks_per_row * type_size), dtype=np.uint8)
    for a, b in _row_chunks(rows, row_length):
        out[a:b] = make(rng, (b - a) * blocks_per_row).reshape(b - a, -1)
    return out


# ---- the tokenizer of the default model --------------------------------------------------------


@lru_cache(maxsize=1)
def _default_gguf_metadata() -> tuple[Path, tuple[tuple[str, object, tuple], ...], int]:
    """(path, every `tokenizer.*` field as (key, value, types), vocabulary size) of the default GGUF."""
    from kvserve.model.loader import default_model_path

    path = default_model_path()
    reader = gguf.GGUFReader(str(path))  # the field types too, to write them back
    fields = tuple((k, f.contents(), tuple(f.types)) for k, f in reader.fields.items() if k.startswith("tokenizer."))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return path, fields, vocab


def _token_id(fields, key: str, default: int | None = None) -> int | None:
    for k, v, _ in fields:
        if k == key:
            return int(v)
    return default


# ---- writers -------------------------------------------------------------------------------


@dataclasses.dataclass
class MadeModel:
    path: Path
    shape_name: str
    fmt: str
    seconds: float
    bytes: int
    tensor_types: dict[str, int]  # type name → tensor count


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _shape_and_tokenizer(shape_name: str):
    """The named shape with the default model's vocabulary, whose tokenizer every made model
    carries: (shape, the default GGUF's path, its metadata fields)."""
    shape = SHAPES[shape_name]
    src, fields, vocab = _default_gguf_metadata()
    return dataclasses.replace(shape, vocab_size=vocab), src, fields


def write_gguf(out: Path, shape_name: str, fmt: str, seed: int = 0, quiet: bool = True, tokenizer: bool = True) -> MadeModel:
    """Write the GGUF. `tokenizer=False` leaves out the tokenizer metadata (the engine cannot
    load such a file; tests use it because `GGUFReader` parses 49152 token strings slowly)."""
    start = time.perf_counter()
    shape, src, fields = _shape_and_tokenizer(shape_name)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")

    a = _gguf_arch(shape)  # the key prefix, as llama.cpp names the architecture
    w = gguf.GGUFWriter(str(tmp), a)
    w.add_type("model")
    w.add_name(f"random {shape_name} {fmt}")
    w.add_string("general.description", f"random weights (std {WEIGHT_STD}) made by tools/make_model.py, seed {seed}; "
                                        f"tokenizer of {src.name}")
    ints = {"context_length": shape.max_position_embeddings, "embedding_length": shape.hidden_size,
            "block_count": shape.num_layers, "feed_forward_length": shape.intermediate_size,
            "rope.dimension_count": shape.head_dim, "attention.head_count": shape.num_heads,
            "attention.head_count_kv": shape.num_kv_heads, "attention.key_length": shape.head_dim,
            "attention.value_length": shape.head_dim, "vocab_size": shape.vocab_size}  # fmt: skip
    for key, value in ints.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", shape.rms_norm_eps)
    w.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    if shape.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", shape.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2
        if getattr(shape, key):
            w.add_float32(f"{a}.{key}", getattr(shape, key))
    if shape.num_experts:  # a mixture of experts, as llama.cpp's converter writes it
        w.add_uint32(f"{a}.expert_count", shape.num_experts)
        w.add_uint32(f"{a}.expert_used_count", shape.num_experts_per_tok)
        w.add_uint32(f"{a}.expert_feed_forward_length", shape.moe_intermediate_size)
    w.add_uint32("general.file_type", _FILE_TYPES[fmt])
    if fmt not in ("f16", "bf16"):
        w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for key, value, types in fields if tokenizer else ():
        w.add_key_value(key, value, types[0], sub_type=types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None)

    plan = []
    counts: dict[str, int] = {}
    for name, tshape in gguf_tensors(shape):
        qtype = tensor_type(fmt, name, shape, tshape[-1])
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        plan.append((name, tshape, qtype))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(tshape)) // block * type_size
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor_info(name, tshape, np.dtype(np.float32 if qtype.name == "F32" else np.float16), nbytes)
        elif qtype == gguf.GGMLQuantizationType.BF16:
            w.add_tensor_info(name, tshape, np.dtype(np.uint16), nbytes, raw_dtype=qtype)
        else:
            byte_shape = (*tshape[:-1], tshape[-1] // block * type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, (name, tshape, qtype) in enumerate(plan):
        w.write_tensor_data(tensor_data(name, tshape, qtype, shape, seed))
        if (k + 1) % 50 == 0:
            _log(f"  {k + 1}/{len(plan)} tensors", quiet)
    w.close()
    os.replace(tmp, out)
    return MadeModel(out, shape_name, fmt, time.perf_counter() - start, out.stat().st_size, counts)


_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(shape: ModelArchitecture, bos: int | None, eos: int | None) -> dict:
    config = {
        "architectures": [_HF_CLASSES[shape.architecture]], "model_type": shape.architecture,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta, "rope_scaling": None, "tie_word_embeddings": shape.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": WEIGHT_STD, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
    }
    if shape.rope_scaling.rope_type == "llama3":
        config["rope_scaling"] = dataclasses.asdict(shape.rope_scaling)
    return config


def _shards(tensors: list[tuple[str, tuple[int, ...]]], limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], make: Callable[[str, tuple], np.ndarray]) -> int:
    """A bf16 safetensors file written tensor by tensor: the header (offsets known from the
    shapes), then each tensor's bytes as it is made."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in tensors:
            data = make(name, shape)
            assert data.dtype == np.uint16 and data.shape == tuple(shape), name
            data.tofile(f)
    return offset


def write_hf(out: Path, shape_name: str, seed: int = 0, quiet: bool = True,
             max_shard_bytes: int = MAX_SHARD_BYTES) -> MadeModel:
    from transformers import AutoTokenizer

    start = time.perf_counter()
    shape, src, fields = _shape_and_tokenizer(shape_name)
    if shape.architecture not in _HF_CLASSES:  # Gemma's config and its stored-w norms: not written yet
        raise ConfigError("format", f"hf-bf16 is not made for the {shape_name} shape ({shape.architecture}); make a GGUF")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    bos, eos = _token_id(fields, "tokenizer.ggml.bos_token_id"), _token_id(fields, "tokenizer.ggml.eos_token_id")
    (out / "config.json").write_text(json.dumps(hf_config(shape, bos, eos), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}, indent=2) + "\n")
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(out))

    def make(name: str, tshape: tuple) -> np.ndarray:
        if len(tshape) == 1:
            return np.full(tshape, 0x3F80, dtype=np.uint16)  # bf16 1.0
        rows, row_length = tshape
        rng = _rng(seed, name)
        data = np.empty(tshape, dtype=np.uint16)
        for a, b in _row_chunks(rows, row_length):
            data[a:b] = _to_bf16_bits(_float_rows(rng, b - a, row_length))
        return data

    shards = _shards(hf_tensors(shape), max_shard_bytes)
    total = 0
    weight_map = {}
    for k, tensors in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_safetensors(out / fname, tensors, make)
        weight_map.update({name: fname for name, _ in tensors})
        _log(f"  wrote {fname}", quiet)
    index = out / "model.safetensors.index.json"
    if len(shards) > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    elif index.exists():
        index.unlink()
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return MadeModel(out, shape_name, "hf-bf16", time.perf_counter() - start, size, {"BF16": len(weight_map)})


def make_model(out: Path | str, shape_name: str, fmt: str, seed: int = 0, quiet: bool = True) -> MadeModel:
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; one of {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if fmt == "hf-bf16":
        return write_hf(Path(out), shape_name, seed, quiet)
    return write_gguf(Path(out), shape_name, fmt, seed, quiet)


def expected_bytes(shape_name: str, fmt: str) -> int:
    """Bytes of the tensors of a made model (what the disk needs, headers aside)."""
    shape = SHAPES[shape_name]
    if fmt == "hf-bf16":
        return sum(int(np.prod(s)) * 2 for _, s in hf_tensors(shape))
    total = 0
    for name, tshape in gguf_tensors(shape):
        block, type_size = gguf.GGML_QUANT_SIZES[tensor_type(fmt, name, shape, tshape[-1])]
        total += int(np.prod(tshape)) // block * type_size
    return total


# ---- checks ---------------------------------------------------------------------------------


@dataclasses.dataclass
class TensorStats:
    name: str
    type_name: str
    mean: float
    std: float
    finite: bool
    min_scale: float | None = None  # the smallest fp16 d of the sampled blocks


def _sample_rows(data: np.ndarray, max_rows: int = 256) -> np.ndarray:
    return data[:max_rows] if data.ndim > 1 else data


def verify_gguf(path: Path | str, shape_name: str, fmt: str, sample: int = 4) -> list[TensorStats]:
    """Check a made GGUF: readable by `gguf.GGUFReader`, every tensor named, typed and shaped
    as planned; a few of each quantized type dequantized (their first 256 rows) to finite
    values of std within 10 % of 0.02 and mean near zero. Raises AssertionError on a miss."""
    shape = SHAPES[shape_name]
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(reader.fields[f"{_gguf_arch(shape)}.vocab_size"].contents())
    planned = gguf_tensors(dataclasses.replace(shape, vocab_size=vocab))
    assert [t.name for t in reader.tensors] == [n for n, _ in planned], "tensor names or order differ from the plan"
    by_type: dict[str, list[str]] = {}
    for name, tshape in planned:
        t = tensors[name]
        want = tensor_type(fmt, name, shape, tshape[-1])
        assert t.tensor_type == want, f"{name}: {t.tensor_type.name}, planned {want.name}"
        assert tuple(int(d) for d in reversed(t.shape)) == tuple(tshape), f"{name}: shape {t.shape}, planned {tshape}"
        if len(tshape) == 2:
            by_type.setdefault(want.name, []).append(name)
    stats = []
    for type_name, names in by_type.items():
        picks = [names[0], names[-1], *names[1:-1][:: max(1, len(names) // sample)]][:sample]
        for name in dict.fromkeys(picks):
            t = tensors[name]
            rows = np.asarray(_sample_rows(t.data))
            values = gguf.quants.dequantize(rows, t.tensor_type).astype(np.float64)
            s = TensorStats(name, type_name, float(values.mean()), float(values.std()), bool(np.isfinite(values).all()),
                            _min_scale(rows, t.tensor_type))
            assert s.finite, f"{name}: non-finite values"
            assert abs(s.std - WEIGHT_STD) < 0.1 * WEIGHT_STD, f"{name}: std {s.std:.4g}, want ≈ {WEIGHT_STD}"
            assert abs(s.mean) < 0.05 * WEIGHT_STD, f"{name}: mean {s.mean:.3g}"
            if s.min_scale is not None:
                assert np.isfinite(s.min_scale) and s.min_scale >= 2.0**-14, f"{name}: fp16 d {s.min_scale} not a normal positive"
            stats.append(s)
    for name in (n for n, s in planned if len(s) == 1 and n != "rope_freqs.weight"):
        assert np.all(np.asarray(tensors[name].data) == 1.0), f"{name}: norm weights are not 1"
    return stats


def _min_scale(rows: np.ndarray, qtype) -> float | None:
    """The smallest super-block / block fp16 d in these rows (None for float types)."""
    if qtype in (T.F16, T.BF16, T.F32):
        return None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rows.reshape(-1, type_size)
    at = type_size - 2 if qtype == T.Q6_K else 0  # Q6_K keeps d last, the rest first
    d = blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)
    return float(d.min())


def forward_check(path: Path | str, token: int = 1) -> dict[str, float]:
    """One token through every layer of a made GGUF in float32 numpy, layer by layer (one
    layer's weights dequantized at a time): the residual stream's RMS after each layer and
    the logits' std. At position 0 attention is the value projection (softmax over one
    position), so Q and K are computed only to check they are finite. Raises on NaN/inf."""
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    f = reader.fields
    a = str(f["general.architecture"].contents())
    n_layers = int(f[f"{a}.block_count"].contents())
    n_heads = int(f[f"{a}.attention.head_count"].contents())
    n_kv = int(f[f"{a}.attention.head_count_kv"].contents())
    eps = float(f[f"{a}.attention.layer_norm_rms_epsilon"].contents())

    def weight(name: str, rows: slice | None = None) -> np.ndarray:
        t = tensors[name]
        data = np.asarray(t.data if rows is None else t.data[rows])
        shape = [int(d) for d in reversed(t.shape)]
        if rows is not None:
            shape[0] = data.shape[0]
        return gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x) + eps) * w

    h = weight("token_embd.weight", slice(token, token + 1))[0]
    report: dict[str, float] = {"embedding_rms": float(np.sqrt(np.mean(h * h)))}
    for i in range(n_layers):
        p = f"blk.{i}."
        x = norm(h, weight(p + "attn_norm.weight"))
        q, k, v = (weight(p + n) @ x for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight"))
        assert np.isfinite(q).all() and np.isfinite(k).all(), f"layer {i}: Q/K not finite"
        attn = np.repeat(v.reshape(n_kv, -1), n_heads // n_kv, axis=0).reshape(-1)
        h = h + weight(p + "attn_output.weight") @ attn
        x = norm(h, weight(p + "ffn_norm.weight"))
        gate, up = weight(p + "ffn_gate.weight") @ x, weight(p + "ffn_up.weight") @ x
        h = h + weight(p + "ffn_down.weight") @ (gate / (1 + np.exp(-gate)) * up)
        report[f"layer_{i}_rms"] = float(np.sqrt(np.mean(h * h)))
        assert np.isfinite(h).all(), f"layer {i}: residual stream not finite"
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    x = norm(h, weight("output_norm.weight"))
    logits = np.concatenate([weight(head, slice(a, b)) @ x for a, b in _row_chunks(int(tensors[head].shape[1]), x.size)])
    assert np.isfinite(logits).all(), "logits not finite"
    report["logits_std"] = float(logits.std())
    return report


# ---- the command ---------------------------------------------------------------------------


def _disk_free(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return os.statvfs(probe).f_bavail * os.statvfs(probe).f_frsize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.make_model", description="Random weights (std 0.02), real "
                                     "shapes, the default model's tokenizer; quantized formats are written as random "
                                     "blocks.")  # fmt: skip
    parser.add_argument("--shape", choices=list(SHAPES), required=True, help="model shape (kvserve.arch_presets)")
    parser.add_argument("--format", choices=list(FORMATS), required=True,
                        help="hf-bf16: an HF directory; the rest a GGUF (q4_k_m: llama.cpp's mix of Q4_K and Q6_K)")
    parser.add_argument("--out", required=True, help="the .gguf file, or the directory for hf-bf16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    parser.add_argument("--no-verify", action="store_true", help="skip reading the GGUF back and checking sampled tensors")
    parser.add_argument("--forward-check", action="store_true",
                        help="also run one token through every layer in numpy and check it stays finite")
    try:
        return _make(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"make_model: error: {exc}", file=sys.stderr)
        return 1


def _make(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if args.format != "hf-bf16" and out.suffix != ".gguf":
        raise ConfigError("--out", f"a GGUF format writes a .gguf file, got {out}")
    if args.format == "hf-bf16" and out.suffix == ".gguf":
        raise ConfigError("--out", f"hf-bf16 writes a directory, got {out}")
    need = expected_bytes(args.shape, args.format)
    free = _disk_free(out.parent if args.format != "hf-bf16" else out)
    if need > free - 2**30:
        raise ConfigError("--out", f"needs {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free there (1 GiB kept free)")
    print(f"making {args.shape} {args.format} → {out} ({need / 1e9:.2f} GB)", file=sys.stderr, flush=True)
    made = make_model(out, args.shape, args.format, seed=args.seed, quiet=False)
    types = ", ".join(f"{n} {k}" for n, k in sorted(made.tensor_types.items()))
    print(f"wrote {made.path}: {made.bytes / 1e9:.3f} GB in {made.seconds:.1f} s ({types})")
    if args.format != "hf-bf16" and not args.no_verify:
        t = time.perf_counter()
        stats = verify_gguf(made.path, args.shape, args.format)
        worst = max(stats, key=lambda s: abs(s.std - WEIGHT_STD))
        print(f"verified: reads back, {len(stats)} sampled tensors finite, std {min(s.std for s in stats):.4g}.."
              f"{max(s.std for s in stats):.4g} (worst {worst.name} {worst.type_name}) in {time.perf_counter() - t:.1f} s")
    if args.forward_check and args.format != "hf-bf16":
        t = time.perf_counter()
        rep = forward_check(made.path)
        rms = [v for k, v in rep.items() if k.startswith("layer_")]
        print(f"forward check: residual RMS {rms[0]:.3g} after layer 0 → {rms[-1]:.3g} after layer {len(rms) - 1}, "
              f"logits std {rep['logits_std']:.3g}, all finite ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
