"""On-disk cache of converted weights, so dequantizing a GGUF happens once.

Entries are safetensors files keyed by the source file's SHA-256 and the target dtype;
the model's architecture rides along in the safetensors metadata, so a cached load never
has to parse the source again. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.arch import ModelArchitecture
from kvserve.paths import cache_root

# Bump when the conversion changes, so stale entries are not reused.
CONVERTER_VERSION = 1


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, remembered per (path, size, mtime) so big files hash once."""
    stat = path.stat()
    index_path = cache_root() / "hashes.json"
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    index[key] = digest
    _atomic_write(index_path, json.dumps(index).encode())
    return digest


def entry_dir(source_sha256: str) -> Path:
    return cache_root() / "converted" / f"{source_sha256[:24]}-v{CONVERTER_VERSION}"


def weights_path(source_sha256: str, dtype: torch.dtype) -> Path:
    return entry_dir(source_sha256) / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"


def load_cached(path: Path) -> tuple[ModelArchitecture, dict[str, torch.Tensor]] | None:
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            arch = ModelArchitecture.from_dict(json.loads(f.metadata()["kvserve.architecture"]))
        from kvserve.model.hf_loader import read_safetensors

        return arch, dict(read_safetensors(path))  # read, not mapped (see read_safetensors)
    except Exception:  # a torn or foreign file: convert again rather than fail
        return None


def store(path: Path, arch: ModelArchitecture, weights: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    contiguous = {name: t.contiguous() for name, t in weights.items()}
    save_file(contiguous, str(tmp), metadata={"kvserve.architecture": json.dumps(arch.to_dict())})
    os.replace(tmp, path)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
