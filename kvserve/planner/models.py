"""Model shapes the planner reasons about: presets, HF `config.json`, GGUF metadata.

Only the shape matters here (layers, widths, heads, vocabulary, parameter count);
no weights are loaded. Files are read by the engine's own readers
(`ModelArchitecture.from_hf_config`, `kvserve.model.gguf_metadata.read_architecture`,
both torch-free), told not to refuse what the engine cannot run. A GGUF's parameter
count is summed from its tensor shapes (exact); a `config.json` has none, so it is
counted from the Llama shapes, QKV bias included where the config has one
(`llama_num_params`, shared with `ModelArchitecture.num_params`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.errors import ConfigError, ModelLoadError
from kvserve.model.arch import ModelArchitecture, llama_num_params
from kvserve.model.gguf_metadata import field as gguf_field
from kvserve.model.gguf_metadata import open_gguf, read_architecture
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
    # bytes of the stored tensors per parameter (a GGUF's own types; `--quantization auto`); None: a float model
    stored_bytes_per_weight: float | None = None
    # what completes the shape for the exact per-chip weight split (weight_shares.py): whether the LM
    # head is the embedding table, and whether Q/K/V carry biases. None: the source does not say
    # (the seed's round 70e9, a custom or overridden shape), and the planner keeps the seed's W/N
    tied_embeddings: bool | None = None
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "d_model", "ffn_width", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size"):
            checks.integer(field, getattr(self, field), 1)
        checks.positive("num_params", self.num_params)
        if self.stored_bytes_per_weight is not None:
            checks.positive("stored_bytes_per_weight", self.stored_bytes_per_weight)
        if self.tied_embeddings is not None and not isinstance(self.tied_embeddings, bool):
            raise ConfigError("tied_embeddings", f"must be true, false or unknown (None), got {self.tied_embeddings!r}")
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

    @property
    def architecture_known(self) -> bool:
        """Every tensor's shape is known (tied embeddings and QKV bias included), so the
        per-chip weight split can be summed exactly (weight_shares.py)."""
        return self.tied_embeddings is not None


PRESETS: dict[str, ModelShape] = {
    "seed-70b": ModelShape(
        "seed-70b", 80, 8192, 28672, 64, 8, 128, 128256, 70e9,
        note="the seed's 70B approximation (LLaMA 3-70B shape); P = 70e9 as the seed counts it",
    ),
    "seed-8b": ModelShape(
        "seed-8b", 32, 4096, 14336, 32, 8, 128, 128256,
        llama_num_params(32, 4096, 14336, 32, 8, 128, 128256, tied_embeddings=False),
        note="§3 states only L=32, N_kv=8, H=128; the other fields are LLaMA 3-8B's", tied_embeddings=False,
    ),
    "smollm2-135m": ModelShape(
        "smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152,
        llama_num_params(30, 576, 1536, 9, 3, 64, 49152, tied_embeddings=True),
        note="SmolLM2-135M (tied embeddings), the engine's default model", tied_embeddings=True,
    ),
}


def from_architecture(arch: ModelArchitecture, name: str, num_params: float, note: str = "") -> ModelShape:
    """The planner's view of an engine `ModelArchitecture`: the same L, D, F, N_q, N_kv, H, V,
    tied embeddings and QKV bias (so the exact per-chip weight split is known)."""
    return ModelShape(
        name, arch.num_layers, arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads,
        arch.head_dim, arch.vocab_size, num_params, note=note, tied_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.attention_bias,
    )


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
        arch = ModelArchitecture.from_hf_config(config, require_supported=False)
    except KeyError as exc:
        raise ModelLoadError(f"{path} has no {exc.args[0]!r}; is it a decoder config.json?") from exc
    bias = "; QKV bias counted" if arch.attention_bias else ""
    return from_architecture(
        arch, path.parent.name or path.stem, arch.num_params, note=f"from {path}; P counted from Llama shapes{bias}",
    )


def from_gguf(path: str | Path) -> ModelShape:
    """Shape from GGUF metadata (`{arch}.block_count`, …); P summed from the tensor shapes."""
    try:
        reader = open_gguf(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"cannot read GGUF {path}: {exc.__cause__ or exc}") from exc
    arch = read_architecture(reader, require_supported=False, source=path)
    num_params = sum(int(tensor.n_elements) for tensor in reader.tensors)
    stored_bytes = sum(int(tensor.n_bytes) for tensor in reader.tensors)
    name = gguf_field(reader, "general.name") or Path(path).stem
    shape = from_architecture(
        arch, str(name), num_params,
        note=f"from GGUF {path}; P summed over {len(reader.tensors)} tensors",
    )
    return replace(shape, stored_bytes_per_weight=stored_bytes / num_params)


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
    if set(changes) & set(_SHAPE_FIELDS):
        changes.setdefault("stored_bytes_per_weight", None)  # the file's bytes no longer describe this shape
    if set(changes) & {*_SHAPE_FIELDS, "num_params"}:
        # a hypothetical model: its P is the override's (or an untied recount), not the source's tensors
        changes.setdefault("tied_embeddings", None)
        changes.setdefault("attention_bias", False)
    return replace(model, **changes)


_SHAPE_FIELDS = ("num_layers", "d_model", "ffn_width", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size")
