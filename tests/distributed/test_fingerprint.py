"""The model files' fingerprint the ranks compare (distributed/fingerprint.py)."""

from __future__ import annotations

import os

from kvserve.distributed.fingerprint import CHUNK, SAMPLES, file_fingerprint, model_fingerprint


def test_the_fingerprint_tells_copies_from_changed_and_truncated_files(tmp_path):
    data = os.urandom(SAMPLES * CHUNK * 3)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(data)
    b.write_bytes(data)
    assert file_fingerprint(a) == file_fingerprint(b)
    changed = bytearray(data)
    at = (len(data) - CHUNK) * 7 // (SAMPLES - 1)  # within the 8th sampled chunk, as a changed tensor would be
    changed[at + 100 : at + 4196] = bytes(4096)
    b.write_bytes(bytes(changed))
    assert file_fingerprint(a) != file_fingerprint(b)
    b.write_bytes(data[:-1])  # one byte short
    assert file_fingerprint(a) != file_fingerprint(b)
    small = tmp_path / "small.safetensors"
    small.write_bytes(b"tiny")  # shorter than a chunk: read whole
    assert file_fingerprint(small) == file_fingerprint(small)


def test_a_directory_fingerprints_its_weight_and_config_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "README.md").write_text("not part of the model")
    assert sorted(model_fingerprint(tmp_path)) == ["config.json", "model.safetensors"]
