"""A GGUF's metadata as a `ModelArchitecture`; torch-free, so the planner reads GGUFs with it.

Only the header is parsed (`gguf.GGUFReader` memory-maps the file; no tensor data is
read). The weights are `kvserve.model.gguf_loader`'s business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.arch import ModelArchitecture, RopeScaling

GGUF_TO_HF_ARCH = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def open_gguf(path: Path | str):
    """A `gguf.GGUFReader` over the file, or ModelLoadError naming it."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except ValueError as exc:
        unknown = _unknown_tensor_type(exc)
        if unknown:
            name, type_id = unknown
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} has GGML tensor type {type_id}, which kvserve (and its gguf package) does "
                "not know"
            ) from exc
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    except Exception as exc:  # gguf raises bare OSError kinds for bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def _unknown_tensor_type(exc: ValueError) -> tuple[str, int] | None:
    """(tensor name, type id) when GGUFReader failed on a tensor type it has no enum for: its
    message names only the number, the tensor is a local of the frame that raised."""
    if "GGMLQuantizationType" not in str(exc):
        return None
    tb = exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if "tensor_name" in local and "raw_dtype" in local:
            return str(local["tensor_name"]), int(local["raw_dtype"][0])
        tb = tb.tb_next
    return None


def field(reader, key: str, default: Any = None) -> Any:
    """A scalar, string or array value of a GGUF metadata field, or `default` if absent."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    if hasattr(entry, "contents"):
        return entry.contents()
    # gguf < 0.11 has no `contents()`: scalars by hand
    values = [entry.parts[i] for i in entry.data]
    if len(values) == 1 and len(values[0]) == 1:
        return values[0][0].item()
    return values


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
    if scaling_type in ("none", None):
        rope_scaling = RopeScaling()
    elif scaling_type == "linear" or not require_supported:
        factor = field(reader, f"{a}.rope.scaling.factor")
        rope_scaling = RopeScaling(rope_type=scaling_type, factor=1.0 if factor is None else float(factor))
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
        rope_scaling=rope_scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )
    return arch.check_supported() if require_supported else arch
