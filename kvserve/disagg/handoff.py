"""What a prefill instance hands a decode instance: the prompt's KV for every layer, its
positions (0..P-1, in order), and the first token with its logprobs.

Serialized as safetensors (no pickle): the KV as one tensor [2, L, P, N_kv, H] in the pool's
dtype (int8 pools add their fp32 scales [2, L, P, N_kv]), the rest as JSON metadata.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


@dataclasses.dataclass
class KVHandoff:
    prompt_token_ids: list[int]
    first_token: int
    # [2, L, P, N_kv, H]: K then V of every layer, positions 0..P-1. None when the transport
    # wrote them straight into the receiving request's blocks (`written_bytes` of them).
    kv: torch.Tensor | None
    scales: torch.Tensor | None = None  # [2, L, P, N_kv] fp32 beside int8 K/V
    first_logprobs: dict[int, float] | None = None  # the first token's top logprobs, when asked
    first_logprob: float = 0.0  # the sampled token's own logprob (0 when not asked)
    written_bytes: int = 0

    @property
    def in_blocks(self) -> bool:
        """Whether the K/V are already in the receiving request's blocks."""
        return self.kv is None

    @property
    def num_positions(self) -> int:
        return len(self.prompt_token_ids) if self.kv is None else self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        if self.kv is None:
            return self.written_bytes
        return self.kv.numel() * self.kv.element_size() + (0 if self.scales is None else self.scales.numel() * 4)

    def to_bytes(self) -> bytes:
        tensors = {"kv": self.kv.contiguous()}
        if self.scales is not None:
            tensors["scales"] = self.scales.contiguous()
        meta = {"prompt_token_ids": self.prompt_token_ids, "first_token": self.first_token,
                "first_logprobs": None if self.first_logprobs is None else {str(k): v for k, v in self.first_logprobs.items()},
                "first_logprob": self.first_logprob}  # fmt: skip
        return st_save(tensors, metadata={"handoff": json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVHandoff":
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")  # safetensors: an 8-byte length, then the JSON header
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["handoff"])
        logprobs = meta["first_logprobs"]
        return cls(
            prompt_token_ids=list(meta["prompt_token_ids"]), first_token=int(meta["first_token"]), kv=tensors["kv"],
            scales=tensors.get("scales"),
            first_logprobs=None if logprobs is None else {int(k): float(v) for k, v in logprobs.items()},
            first_logprob=float(meta["first_logprob"]),
        )  # fmt: skip
