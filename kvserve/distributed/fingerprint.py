"""What the ranks compare before they start: a fingerprint of the model's files.

Ranks started by torchrun on several hosts each load their own copy of the model. Two copies
that differ (another quantization, another checkpoint, a half-copied file) would load and
then compute garbage together, so the engine compares this fingerprint across ranks
(distributed/launch.py `check_ranks_agree`) and refuses to start, naming the rank.

A full SHA-256 of an 8B checkpoint reads 16 GB at every first start; the fingerprint reads
a fixed 1 MiB per file instead: its size and 16 chunks of 64 KiB spread evenly over it (the
header, the last bytes, and 14 between). Different checkpoints of one architecture differ
in every tensor, and a truncated or half-copied file in its size or its tail, so the samples
tell them apart at a cost that does not grow with the model. A change confined to bytes
between the samples (one edited tensor of a copied file) goes unseen: the check is for
mix-ups between hosts, not for tampering.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES = 16
CHUNK = 64 << 10
# what a model directory's weights and shape live in (tokenizer files are compared through the model's name and arch)
_MODEL_FILES = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "config.json")


def file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, (size - CHUNK) * i // (SAMPLES - 1)))
            h.update(f.read(CHUNK))
    return h.hexdigest()[:16]


def model_fingerprint(source: Path) -> dict[str, str]:
    """File name -> fingerprint, for a model file or every weight and config file of a directory."""
    source = Path(source)
    if source.is_file():
        return {source.name: file_fingerprint(source)}
    files = sorted({p for pattern in _MODEL_FILES for p in source.glob(pattern) if p.is_file()})
    return {p.name: file_fingerprint(p) for p in files}
