"""The model a plan is for: the engine's shape (`ModelArchitecture`) and its parameter count P.

Only the shape matters here; no weights are loaded. It comes from a preset (the shared set,
`kvserve.arch_presets`), a `config.json` or GGUF metadata, read by the engine's own readers
(`read_hf_config`, `kvserve.model.gguf_metadata.read_architecture`, both torch-free), told not
to refuse what the engine cannot run. A GGUF's P is summed from its tensor shapes (exact); a
`config.json` has none, so P is counted from the Llama shapes (`ModelArchitecture.num_params`,
QKV bias included where the config has one).

The seed names the shape L, D, F, N_q, N_kv, H, V: `SEED_NAMES` maps those names (the
`plan run` flags, the JSON's keys) to the architecture's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.errors import ConfigError, ModelLoadError
from kvserve import arch_presets as presets
from kvserve.arch import ModelArchitecture, read_hf_config
from kvserve.model.gguf_metadata import field as gguf_field
from kvserve.model.gguf_metadata import open_gguf, read_architecture
from kvserve.planner import checks

SEED_NAMES = {  # the seed's name: ModelArchitecture's field
    "num_layers": "num_layers", "d_model": "hidden_size", "ffn_width": "intermediate_size",
    "num_query_heads": "num_heads", "num_kv_heads": "num_kv_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
}  # fmt: skip


@dataclass(frozen=True)
class PlannedModel:
    name: str
    arch: ModelArchitecture
    num_params: float  # P
    note: str = ""
    # bytes of the stored tensors per parameter (a GGUF's own types; `--quantization auto`); None: a float model
    stored_bytes_per_weight: float | None = None
    # the arch's tied embeddings and QKV bias are the real model's, so the exact per-chip weight
    # split can be summed (weight_shares.py); False (the seed's round 70e9, a custom or overridden
    # shape): the planner keeps the seed's W/N
    architecture_known: bool = True

    def __post_init__(self) -> None:
        for name, field in SEED_NAMES.items():
            checks.integer(name, getattr(self.arch, field), 1)
        checks.positive("num_params", self.num_params)
        if self.stored_bytes_per_weight is not None:
            checks.positive("stored_bytes_per_weight", self.stored_bytes_per_weight)
        if self.arch.num_heads % self.arch.num_kv_heads:
            raise ConfigError(
                "num_kv_heads",
                f"must divide num_query_heads ({self.arch.num_heads}) so each KV head serves "
                f"a whole group of queries, got {self.arch.num_kv_heads}",
            )

    def as_json(self) -> dict:
        """In the seed's names, as `plan run --json` writes the model."""
        a = self.arch
        return {"name": self.name, **{name: getattr(a, field) for name, field in SEED_NAMES.items()},
                "num_params": self.num_params, "note": self.note, "stored_bytes_per_weight": self.stored_bytes_per_weight,
                "tied_embeddings": a.tie_word_embeddings if self.architecture_known else None,
                "attention_bias": a.attention_bias}  # fmt: skip


def _preset(name: str, arch: ModelArchitecture) -> PlannedModel:
    if name == "seed-70b":  # the seed's round P: no exact split beside it
        return PlannedModel(name, arch, 70e9, presets.NOTES[name], architecture_known=False)
    return PlannedModel(name, arch, arch.num_params, presets.NOTES[name])


PRESETS: dict[str, PlannedModel] = {name: _preset(name, arch) for name, arch in presets.PRESETS.items()}


def from_hf_config(path: str | Path) -> PlannedModel:
    """A Hugging Face `config.json` (a file, or a directory holding one)."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    arch = read_hf_config(path, require_supported=False)
    bias = "; QKV bias counted" if arch.attention_bias else ""
    return PlannedModel(path.parent.name or path.stem, arch, arch.num_params,
                        note=f"from {path}; P counted from Llama shapes{bias}")


def from_gguf(path: str | Path) -> PlannedModel:
    """GGUF metadata (`{arch}.block_count`, …); P summed from the tensor shapes."""
    try:
        reader = open_gguf(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"cannot read GGUF {path}: {exc.__cause__ or exc}") from exc
    arch = read_architecture(reader, require_supported=False, source=path)
    num_params = sum(int(tensor.n_elements) for tensor in reader.tensors)
    stored_bytes = sum(int(tensor.n_bytes) for tensor in reader.tensors)
    name = gguf_field(reader, "general.name") or Path(path).stem
    return PlannedModel(str(name), arch, num_params, note=f"from GGUF {path}; P summed over {len(reader.tensors)} tensors",
                        stored_bytes_per_weight=stored_bytes / num_params)  # fmt: skip


def load_model(source: str) -> PlannedModel:
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


def with_overrides(model: PlannedModel, **fields) -> PlannedModel:
    """The model with the given (non-None) fields replaced (the shape's in `SEED_NAMES`), revalidated.

    A changed shape without a new `num_params` gets P recounted from the Llama shapes
    (untied), since keeping the old count would silently mix two models.
    """
    changes = {k: v for k, v in fields.items() if v is not None}
    shape = {SEED_NAMES[k]: changes.pop(k) for k in [*changes] if k in SEED_NAMES}
    if not shape and "num_params" not in changes:
        return replace(model, **changes)
    # a hypothetical model: its P is the override's (or an untied recount), not the source's tensors
    arch = replace(model.arch, **shape, tie_word_embeddings=False, attention_bias=False)
    if "num_params" not in changes:
        changes["num_params"] = arch.num_params
        changes.setdefault("note", f"{model.name} with overrides; P recounted from Llama shapes (untied)")
    if shape:
        changes.setdefault("stored_bytes_per_weight", None)  # the file's bytes no longer describe this shape
    return replace(model, arch=arch, architecture_known=False, **changes)
