"""Model shapes the planner reasons about: presets, HF `config.json`, GGUF metadata.

Only the shape matters here (layers, widths, heads, vocabulary, parameter count);
no weights are loaded. A GGUF's parameter count is summed from its tensor shapes;
a `config.json` has none, so it is counted from the Llama shapes (`llama_num_params`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.errors import ConfigError, ModelLoadError
from kvserve.planner import checks


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int  # L
    d_model: int  # D
    ffn_width: int  # F
    num_query_heads: int  # N_q
    num_kv_heads: int  # N_kv
    head_dim: int  # H
    vocab_size: int  # V
    num_params: float  # P
    note: str = ""

    def __post_init__(self) -> None:
        for field in ("num_layers", "d_model", "ffn_width", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size"):
            checks.integer(field, getattr(self, field), 1)
        checks.positive("num_params", self.num_params)
        if self.num_query_heads % self.num_kv_heads:
            raise ConfigError(
                "num_kv_heads",
                f"must divide num_query_heads ({self.num_query_heads}) so each KV head serves "
                f"a whole group of queries, got {self.num_kv_heads}",
            )

    @property
    def queries_per_kv_head(self) -> int:
        """g: Query heads sharing one KV head (GQA group size)."""
        return self.num_query_heads // self.num_kv_heads


def llama_num_params(
    num_layers: int, d_model: int, ffn_width: int, num_query_heads: int, num_kv_heads: int,
    head_dim: int, vocab_size: int, tied_embeddings: bool,
) -> int:
    """Parameters of a Llama-shaped decoder: embeddings, Q/K/V/O, gated MLP, two norms a layer."""
    attention = d_model * head_dim * (2 * num_query_heads + 2 * num_kv_heads)
    mlp = 3 * d_model * ffn_width
    per_layer = attention + mlp + 2 * d_model
    embeddings = vocab_size * d_model * (1 if tied_embeddings else 2)
    return num_layers * per_layer + embeddings + d_model


PRESETS: dict[str, ModelShape] = {
    "seed-70b": ModelShape(
        "seed-70b", 80, 8192, 28672, 64, 8, 128, 128256, 70e9,
        note="the seed's 70B approximation (LLaMA 3-70B shape); P = 70e9 as the seed counts it",
    ),
    "seed-8b": ModelShape(
        "seed-8b", 32, 4096, 14336, 32, 8, 128, 128256,
        llama_num_params(32, 4096, 14336, 32, 8, 128, 128256, tied_embeddings=False),
        note="§3 states only L=32, N_kv=8, H=128; the other fields are LLaMA 3-8B's",
    ),
    "smollm2-135m": ModelShape(
        "smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152,
        llama_num_params(30, 576, 1536, 9, 3, 64, 49152, tied_embeddings=True),
        note="SmolLM2-135M (tied embeddings), the engine's default model",
    ),
}


def from_hf_config(path: str | Path) -> ModelShape:
    """Shape from a Hugging Face `config.json` (a file, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read HF config {path}: {exc}") from exc
    config = config.get("text_config", config)  # multimodal configs nest the decoder
    try:
        num_layers = config["num_hidden_layers"]
        d_model = config["hidden_size"]
        ffn_width = config["intermediate_size"]
        num_query_heads = config["num_attention_heads"]
        vocab_size = config["vocab_size"]
    except KeyError as exc:
        raise ModelLoadError(f"{path} has no {exc.args[0]!r}; is it a decoder config.json?") from exc
    num_kv_heads = config.get("num_key_value_heads") or num_query_heads
    head_dim = config.get("head_dim") or d_model // num_query_heads
    num_params = llama_num_params(
        num_layers, d_model, ffn_width, num_query_heads, num_kv_heads, head_dim, vocab_size,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    return ModelShape(
        path.parent.name or path.stem, num_layers, d_model, ffn_width, num_query_heads, num_kv_heads,
        head_dim, vocab_size, num_params, note=f"from {path}; P counted from Llama shapes",
    )


def _field(reader, key: str):
    """A scalar, string or array value of a GGUF metadata field, or None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    values = [field.parts[i] for i in field.data]
    if len(values) == 1 and len(values[0]) == 1:
        return values[0][0].item()
    return values


def from_gguf(path: str | Path) -> ModelShape:
    """Shape from GGUF metadata (`{arch}.block_count`, …); P summed from the tensor shapes."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises bare ValueError/OSError kinds for bad files
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc
    arch = _field(reader, "general.architecture") or "llama"

    def required(suffix: str) -> int:
        value = _field(reader, f"{arch}.{suffix}")
        if value is None:
            raise ModelLoadError(f"{path} has no {arch}.{suffix} metadata")
        return int(value)

    num_layers = required("block_count")
    d_model = required("embedding_length")
    num_query_heads = required("attention.head_count")
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or num_query_heads)
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or d_model // num_query_heads)
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{path} has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    num_params = sum(int(tensor.n_elements) for tensor in reader.tensors)
    name = _field(reader, "general.name") or Path(path).stem
    return ModelShape(
        str(name), num_layers, d_model, required("feed_forward_length"), num_query_heads, num_kv_heads,
        head_dim, int(vocab_size), num_params, note=f"from GGUF {path}; P summed over {len(reader.tensors)} tensors",
    )


def load_model(source: str) -> ModelShape:
    """A preset name, a `.gguf` file, or a `config.json` (file or directory)."""
    if source in PRESETS:
        return PRESETS[source]
    path = Path(source)
    if path.suffix == ".gguf":
        return from_gguf(path)
    if path.suffix == ".json" or path.is_dir():
        return from_hf_config(path)
    raise ConfigError(
        "model", f"unknown preset {source!r}; use one of {', '.join(PRESETS)}, a .gguf file or a config.json"
    )


def with_overrides(model: ModelShape, **fields) -> ModelShape:
    """The shape with the given (non-None) fields replaced, revalidated.

    A changed shape without a new `num_params` gets P recounted from the Llama shapes
    (untied embeddings), since keeping the old count would silently mix two models.
    """
    changes = {k: v for k, v in fields.items() if v is not None}
    if not changes:
        return model
    if "num_params" not in changes and set(changes) - {"name", "note"}:
        shape = {k: changes.get(k, getattr(model, k)) for k in _SHAPE_FIELDS}
        changes["num_params"] = llama_num_params(**shape, tied_embeddings=False)
        changes.setdefault("note", f"{model.name} with overrides; P recounted from Llama shapes (untied)")
    return replace(model, **changes)


_SHAPE_FIELDS = ("num_layers", "d_model", "ffn_width", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size")
