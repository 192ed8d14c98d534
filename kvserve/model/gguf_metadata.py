"""A GGUF's metadata as a `ModelArchitecture`; torch-free, so the planner reads GGUFs with it.

Only the header is parsed, by our own reader (`open_gguf`): no tensor data is read and the
vocabulary is not decoded unless asked for. The weights are `kvserve.model.gguf_loader`'s
business.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from pathlib import Path
from typing import Any

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.arch import ModelArchitecture, RopeScaling
# GGUF general.architecture -> HF model_type: each family's own (families/)
from kvserve.families import GGUF_TO_HF_ARCH, GGUFMeta, family_of


_MAGIC = b"GGUF"
# value types of the GGUF spec: struct formats of the fixed-size ones
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Field:
    """One metadata value. String arrays (a 150k-token vocabulary) are decoded only when asked."""

    def __init__(self, value: Any = None, lazy: tuple[memoryview, int, int] | None = None):
        self._value = value
        self._lazy = lazy

    def contents(self) -> Any:
        if self._lazy is not None:
            buf, pos, count = self._lazy
            items = []
            for _ in range(count):
                n = struct.unpack_from("<Q", buf, pos)[0]
                items.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
            self._value, self._lazy = items, None
        return self._value

    def __len__(self) -> int:
        return self._lazy[2] if self._lazy is not None else len(self._value)


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file


@dataclasses.dataclass
class GGUFHeader:
    """A GGUF's metadata and tensor table, parsed without reading tensor data or decoding the
    vocabulary: `gguf.GGUFReader` builds numpy objects for every token and merge, which
    peaked 160 MB for the default model's 49,152-token vocabulary (more than its weights)."""

    path: Path
    fields: dict[str, _Field]
    tensors: list[GGUFTensorInfo]


def open_gguf(path: Path | str) -> GGUFHeader:
    """The header of a GGUF file, or ModelLoadError naming it (UnsupportedModelError for a
    tensor type the `gguf` package does not know, naming the tensor)."""
    import gguf

    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            buf = memoryview(mapped)
            try:
                return _parse(path, buf, gguf)
            finally:
                buf.release()
    except (UnsupportedModelError, ModelLoadError):
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def _parse(path: Path, mapped: memoryview, gguf) -> GGUFHeader:
    if bytes(mapped[:4]) != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mapped, 4)
    if version < 2:
        raise ModelLoadError(f"{path}: GGUF version {version} is too old (2 or later is read)")
    # the header is copied out of the mapping: lazy string arrays keep a view of it, not the file
    buf = memoryview(bytes(mapped[: _header_end(mapped, 24, n_kv, n_tensors)]))
    pos = 24
    fields: dict[str, _Field] = {}

    def string(at: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", buf, at)[0]
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n

    def value(kind: int, at: int) -> tuple[_Field, int]:
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return _Field(struct.unpack_from(fmt, buf, at)[0]), at + struct.calcsize(fmt)
        if kind == _STRING:
            text, at = string(at)
            return _Field(text), at
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item == _STRING:
                start = at
                for _ in range(count):
                    at += 8 + struct.unpack_from("<Q", buf, at)[0]
                return _Field(lazy=(buf, start, count)), at
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt)
                items = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, at)) if count else []
                return _Field(items), at + size * count
            values = []
            for _ in range(count):
                v, at = value(item, at)
                values.append(v.contents())
            return _Field(values), at
        raise ModelLoadError(f"{path}: unknown GGUF metadata value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        kind = struct.unpack_from("<I", buf, pos)[0]
        fields[key], pos = value(kind, pos + 4)

    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} has GGML tensor type {type_id}, which kvserve (and its gguf package) does not know"
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = 1
        for d in dims:
            n *= int(d)
        infos.append(GGUFTensorInfo(name, qtype, tuple(int(d) for d in dims), n, n // block * type_size, offset))
    alignment = int(fields["general.alignment"].contents()) if "general.alignment" in fields else 32
    data_start = -(-pos // alignment) * alignment
    tensors = [dataclasses.replace(t, data_offset=data_start + t.data_offset) for t in infos]
    return GGUFHeader(path, fields, tensors)


def _header_end(buf: memoryview, pos: int, n_kv: int, n_tensors: int) -> int:
    """Where the tensor table ends: a first pass that only skips."""

    def skip_string(at: int) -> int:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]

    def skip_value(kind: int, at: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            return skip_string(at)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                return at + struct.calcsize(_SCALARS[item]) * count
            for _ in range(count):
                at = skip_value(item, at)
            return at
        raise ValueError(f"unknown GGUF metadata value type {kind}")

    for _ in range(n_kv):
        pos = skip_string(pos)
        kind = struct.unpack_from("<I", buf, pos)[0]
        pos = skip_value(kind, pos + 4)
    for _ in range(n_tensors):
        pos = skip_string(pos)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        pos += 4 + 8 * n_dims + 12
    return pos


def field(reader, key: str, default: Any = None) -> Any:
    """A scalar, string or array value of a GGUF metadata field, or `default` if absent."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    return entry.contents()


def read_architecture(reader, *, require_supported: bool = True, source: Path | str | None = None) -> ModelArchitecture:
    """The architecture in a GGUF's metadata (`{arch}.block_count`, …).

    With `require_supported` (the engine) an architecture or RoPE scaling the engine does
    not run raises UnsupportedModelError; without it (the planner) any Llama-shaped
    header is read, under its own `general.architecture` prefix (default `llama`).
    `source` names the file in errors.
    """
    where = f"{source}" if source is not None else "GGUF"
    gguf_arch = field(reader, "general.architecture")
    if require_supported and gguf_arch not in GGUF_TO_HF_ARCH:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {gguf_arch!r}; kvserve runs {', '.join(GGUF_TO_HF_ARCH)}"
        )
    a = gguf_arch or "llama"

    def required(suffix: str) -> int:
        value = field(reader, f"{a}.{suffix}")
        if value is None:
            raise ModelLoadError(f"{where} has no {a}.{suffix} metadata")
        return int(value)

    num_layers = required("block_count")
    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    ffn_width = required("feed_forward_length")
    vocab_size = field(reader, f"{a}.vocab_size")
    if vocab_size is None:  # read the token list only when needed: it can be 150k strings
        tokens = field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{where} has neither {a}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    scaling_type = field(reader, f"{a}.rope.scaling.type", "none")
    if any(t.name == "rope_factors_long.weight" for t in reader.tensors):
        # llama.cpp's Phi-3 LongRoPE: the factors are tensors (read with the weights), the
        # original context and the cos/sin factor metadata
        original = field(reader, f"{a}.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"{where}: LongRoPE factors without {a}.rope.scaling.original_context_length")
        attn = field(reader, f"{a}.rope.scaling.attn_factor")
        rope_scaling = RopeScaling(
            rope_type="longrope", original_max_position_embeddings=int(original),
            factor=int(field(reader, f"{a}.context_length", 4096)) / int(original),
            attention_factor=None if attn is None else float(attn),
        )  # fmt: skip
    elif scaling_type in ("none", None):
        rope_scaling = RopeScaling()
    elif scaling_type == "linear" or not require_supported:
        factor = field(reader, f"{a}.rope.scaling.factor")
        rope_scaling = RopeScaling(rope_type=scaling_type, factor=1.0 if factor is None else float(factor))
    elif scaling_type == "yarn":  # llama.cpp's keys; the ramp's betas where the converter wrote them
        factor = field(reader, f"{a}.rope.scaling.factor")
        original = field(reader, f"{a}.rope.scaling.original_context_length")
        if factor is None or original is None:
            raise ModelLoadError(f"{where}: yarn RoPE scaling without {a}.rope.scaling.factor and .original_context_length")
        # llama.cpp multiplies its own 1 + 0.1·ln(factor) by the file's attn_factor (default 1)
        attn = float(field(reader, f"{a}.rope.scaling.attn_factor", 1.0))
        rope_scaling = RopeScaling(
            rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original),
            beta_fast=float(field(reader, f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(field(reader, f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=attn * ((1.0 + 0.1 * math.log(float(factor))) if float(factor) > 1 else 1.0),
        )  # fmt: skip
    else:
        raise UnsupportedModelError(f"unsupported GGUF rope scaling {scaling_type!r}")
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = field(reader, key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    arch = ModelArchitecture(
        architecture=GGUF_TO_HF_ARCH.get(a, a),
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=ffn_width,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(field(reader, f"{a}.attention.head_count_kv") or num_heads),
        head_dim=int(field(reader, f"{a}.attention.key_length") or hidden // num_heads),
        rms_norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        qk_norm=any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors),
        partial_rotary_factor=_partial_rotary(reader, a, hidden, num_heads),
        **_family_options(reader, a, num_layers, hidden, num_heads),
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )
    return arch.check_supported() if require_supported else arch


def _partial_rotary(reader, a: str, hidden: int, num_heads: int) -> float:
    """rotary_dim / head_dim from `{arch}.rope.dimension_count` (llama.cpp's rotary width)."""
    head_dim = int(field(reader, f"{a}.attention.key_length") or hidden // num_heads)
    rotary = field(reader, f"{a}.rope.dimension_count")
    return 1.0 if rotary is None or int(rotary) >= head_dim else int(rotary) / head_dim


def _family_options(reader, a: str, num_layers: int, hidden: int, num_heads: int) -> dict[str, Any]:
    """The fields the file's family reads from its metadata (families/), none for a
    header no family reads (the planner's)."""
    model_type = GGUF_TO_HF_ARCH.get(a)
    if model_type is None:
        return {}
    head_dim = int(field(reader, f"{a}.attention.key_length") or hidden // num_heads)
    meta = GGUFMeta(a, num_layers, hidden, num_heads, head_dim, lambda key: field(reader, key))
    options = family_of(model_type).gguf_options(meta, model_type)
    if options.get("num_experts"):  # a mixture of experts' dense layers: those without a router
        routed = {t.name for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
        options["dense_layers"] = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in routed)
    return options
