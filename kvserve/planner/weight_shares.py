"""The exact weight bytes on the busiest chip, split as the engine splits a model.

The seed's W/N = P·p_w/N spreads every parameter evenly over the N chips, and the seed
itself calls that an approximation (layout.py: "duplicated K/V projections would add to
it"). The engine's tensor-parallel split (kvserve/distributed/sharding.py `plan_shard`,
`model/shard_weights.py`) differs from it in three ways, all of which put more on a chip:

- the RMSNorm weights (two per layer and the final one) are replicated, whole, on every chip;
- past N_kv chips each KV head's K and V projections (and biases) are held by N/N_kv chips;
- the embedding table and LM head are cut into ⌈V/N⌉ rows each, rank 0 the fullest.

So the busiest chip is rank 0, and its bytes are summed here tensor by tensor from the
model's full shape (L, D, F, N_q, N_kv, H, V, tied embeddings, QKV bias), in the format the
engine stores each tensor in (`kvserve/model/loader.py` `_quantizer`,
`kvserve/model/quant_formats.py`), which is what its start-up report prints per rank
(`LlamaForCausalLM.weight_bytes`, with one copy of each weight held):

| format               | a projection's [r, c] share                          | norms, biases |
| -------------------- | ---------------------------------------------------- | ------------- |
| float (p_w B each)   | r·c·p_w                                              | p_w each      |
| int8 (per channel)   | r·c codes + 2·r (an fp16 scale per output row)       | bf16          |
| int4 (Q4_1's rule)   | r·c/2 codes + 2·2·r·c/32 (fp16 scale, min per 32)   | bf16          |

int4 keeps the embedding and LM head at int8, as the engine does. A weight whose full shape
is off the packed grid (rows not a multiple of 16, columns of 32) stays bf16; a quantized
weight cut inside a packed group or block is refused, as the engine refuses it. Both layouts
(`heads`, `requests`) split the weights this same way; only the KV placement differs.

Where the figure cannot be known (the shape's source does not say whether embeddings are
tied; a GGUF's own block formats; a split the engine refuses), `weight_share` returns the
reason instead, and the planner keeps the seed's W/N. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.arch import ModelArchitecture

# the packed layout's grid (kvserve/kernels/layouts.py GROUP and BLOCK, kept as numbers so the
# planner stays torch-free; a test checks they agree)
GROUP_ROWS = 16
BLOCK_COLS = 32
FLOAT_BYTES_WITH_QUANTIZED = 2  # norms, biases and off-grid weights beside int8/int4: bf16 (quant_linear's dtype)
QUANTIZED_FORMATS = ("int8", "int4")


@dataclass(frozen=True)
class WeightStorage:
    """How the engine stores the weights: `kind` "float" (every weight `element_bytes`), "int8" or "int4"."""

    kind: str
    element_bytes: float = 2.0

    def describe(self) -> str:
        return f"float, {self.element_bytes:g} B per weight" if self.kind == "float" else self.kind


@dataclass(frozen=True)
class RankSlices:
    """Rank `rank` of `world`'s [first, end) ranges (sharding.py's `TensorParallelShard`)."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    kv_replication: int


@dataclass(frozen=True)
class WeightShare:
    """The busiest chip's (rank 0's) weights: parameters and bytes as stored."""

    num_chips: int
    storage: WeightStorage
    params: int  # parameters this chip holds
    weight_bytes: float  # their bytes as stored (an int for whole-byte formats)
    parts: dict  # bytes by part: "layers" (all L of them), "embedding", "lm_head" (0 when tied), "final_norm"
    num_layers: int
    kv_replication: int  # chips holding each KV head (and its K/V projections)

    @property
    def per_layer_bytes(self) -> float:
        return self.parts["layers"] / self.num_layers


class ShareUnknown(ValueError):
    """Why the exact share cannot be computed (the planner falls back to W/N and says so)."""


def rank_slices(num_query_heads: int, num_kv_heads: int, ffn_width: int, vocab_size: int, rank: int, world: int) -> RankSlices:
    """`plan_shard`'s ranges without torch: whole query heads per rank; N_kv/N KV heads each
    where N divides N_kv, else the one KV head a rank's query heads read; F/N FFN columns;
    ⌈V/N⌉ vocabulary rows (the last rank fewer). ShareUnknown where the engine refuses."""
    nq, nkv, f = num_query_heads, num_kv_heads, ffn_width
    if nq % world:
        raise ShareUnknown(f"{world} ranks cannot split {nq} query heads (each rank computes whole heads)")
    if nkv % world and world % nkv:
        raise ShareUnknown(f"{world} ranks over {nkv} KV heads: neither divides the other")
    if f % world:
        raise ShareUnknown(f"{world} ranks cannot split the FFN width {f} into equal columns")
    per_q = nq // world
    q0 = rank * per_q
    if world <= nkv:
        per_kv = nkv // world
        kv, replication = (rank * per_kv, (rank + 1) * per_kv), 1
    else:
        g = nq // nkv
        kv, replication = (q0 // g, q0 // g + 1), world // nkv
    per_v = -(-vocab_size // world)
    v0 = min(rank * per_v, vocab_size)
    per_f = f // world
    return RankSlices(rank, world, (q0, q0 + per_q), kv, (rank * per_f, (rank + 1) * per_f),
                      (v0, min(v0 + per_v, vocab_size)), replication)  # fmt: skip


def storage_for(weight_format: str | None, bytes_per_weight: float, stored_bytes_per_weight: float | None) -> WeightStorage:
    """The engine's storage for the planner's inputs: `--quantization NAME` (weight_format)
    or a bare p_w (`--bytes-per-weight`, default 2: bf16). ShareUnknown for GGUF block
    formats, whose per-tensor types the shape does not carry."""
    if weight_format is None:
        return WeightStorage("float", bytes_per_weight)
    if weight_format == "none":
        return WeightStorage("float", 2.0)
    if weight_format == "auto":
        if stored_bytes_per_weight is None:
            return WeightStorage("float", 2.0)
        raise ShareUnknown("--quantization auto of a .gguf keeps its own per-tensor block types, not modelled per shard")
    if weight_format in QUANTIZED_FORMATS:
        return WeightStorage(weight_format)
    raise ShareUnknown(f"--quantization {weight_format}: a GGUF block format, not modelled per shard")


def _float_bytes(storage: WeightStorage, elements: int) -> float:
    p = storage.element_bytes if storage.kind == "float" else FLOAT_BYTES_WITH_QUANTIZED
    b = elements * p
    return int(b) if float(b).is_integer() else b


def _matrix_bytes(storage: WeightStorage, name: str, full: tuple[int, int], cut: str | None, lo: int, hi: int,
                  table: bool = False) -> float:  # fmt: skip
    """Bytes of the [lo, hi) rows (cut "rows") or columns ("cols") of a weight of shape `full`
    (cut None: all of it), stored as the engine stores it; `table`: the embedding or LM head,
    which int4 keeps at int8."""
    rows, cols = full
    r, c = (hi - lo, cols) if cut == "rows" else (rows, hi - lo) if cut == "cols" else (rows, cols)
    if storage.kind == "float" or not (rows % GROUP_ROWS == 0 and cols % BLOCK_COLS == 0 and rows > 0):
        return _float_bytes(storage, r * c)  # off the packed grid: the loader keeps it float
    unit = GROUP_ROWS if cut == "rows" else BLOCK_COLS
    if cut is not None and (lo % unit or hi % unit):
        what = "rows" if cut == "rows" else "columns"
        raise ShareUnknown(f"{name} in {storage.kind} cannot be split at {what} [{lo}, {hi}) (not whole packed "
                           f"{'groups of 16 rows' if cut == 'rows' else 'blocks of 32 columns'}); the engine refuses it")
    if storage.kind == "int8" or table:  # int8 per output channel: codes and one fp16 scale per row
        return r * c + 2 * r
    return r * c // 2 + 4 * r * (c // BLOCK_COLS)  # int4: 4-bit codes, fp16 scale and min per block of 32


def weight_share(arch: ModelArchitecture, num_chips: int, storage: WeightStorage, rank: int = 0) -> WeightShare:
    """Rank `rank`'s weights (default 0, the busiest: the most vocabulary rows) on `num_chips`
    tensor-parallel chips. ShareUnknown where the engine would refuse the split."""
    a = arch
    if a.num_experts:  # its experts, routers and dense layers are not split here (W/N stands in)
        raise ShareUnknown("a mixture of experts' per-chip split is not counted exactly (W/N stands in)")
    shape = (a.num_layers, a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size,
             a.tie_word_embeddings, a.attention_bias, storage)  # fmt: skip
    slices = rank_slices(a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size, rank, num_chips)
    parts, params = _rank_parts(slices, *shape)
    if storage.kind != "float":  # the engine refuses if any rank's cut falls inside a packed group or block
        for r in range(num_chips):
            if r != rank:
                _rank_parts(rank_slices(a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size, r, num_chips), *shape)
    total = sum(parts.values())
    total = int(total) if float(total).is_integer() else total
    return WeightShare(num_chips, storage, params, total, parts, a.num_layers, slices.kv_replication)


def _rank_parts(s: RankSlices, L, D, F, nq, nkv, H, V, tied, bias, storage) -> tuple[dict, int]:
    whole = s.world == 1
    q0, q1 = s.q_heads[0] * H, s.q_heads[1] * H
    k0, k1 = s.kv_heads[0] * H, s.kv_heads[1] * H
    f0, f1 = s.ffn
    v0, v1 = s.vocab
    rows, cols = (None, None) if whole else ("rows", "cols")

    def m(name, full, cut, lo, hi, table=False):
        return _matrix_bytes(storage, name, full, cut, lo, hi, table)

    layer = (
        m("q_proj", (nq * H, D), rows, q0, q1)
        + 2 * m("k_proj/v_proj", (nkv * H, D), rows, k0, k1)
        + m("o_proj", (D, nq * H), cols, q0, q1)
        + 2 * m("gate_proj/up_proj", (F, D), rows, f0, f1)
        + m("down_proj", (D, F), cols, f0, f1)
        + _float_bytes(storage, 2 * D)  # input and post-attention RMSNorm, replicated
    )
    layer_params = (q1 - q0) * D + 2 * (k1 - k0) * D + D * (q1 - q0) + 2 * (f1 - f0) * D + D * (f1 - f0) + 2 * D
    if bias:  # Q/K/V biases, cut with their rows, kept float
        layer += _float_bytes(storage, (q1 - q0) + 2 * (k1 - k0))
        layer_params += (q1 - q0) + 2 * (k1 - k0)
    embedding = m("embed_tokens", (V, D), rows, v0, v1, table=True)
    lm_head = 0 if tied else m("lm_head", (V, D), rows, v0, v1, table=True)  # tied: one table, held once
    parts = {"layers": L * layer, "embedding": embedding, "lm_head": lm_head, "final_norm": _float_bytes(storage, D)}
    params = L * layer_params + (v1 - v0) * D * (1 if tied else 2) + D
    return parts, params
