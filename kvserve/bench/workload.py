"""Synthetic workloads: random token-id prompts of chosen lengths, the same for every engine.

Random ids give exact prompt lengths (no tokenizer round trip) and defeat the prefix
cache, so a benchmark measures computation rather than cache hits. Outputs run with
`ignore_eos`, so each request produces exactly its output length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "output_lens": self.output_lens}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Workload":
        return cls([list(map(int, p)) for p in data["prompts"]], [int(n) for n in data["output_lens"]])

    def describe(self) -> dict[str, Any]:
        """What the workload was, without its token ids (for reports and JSON)."""
        in_lens = [len(p) for p in self.prompts]
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "input_len_min_max": [min(in_lens), max(in_lens)] if in_lens else None,
            "output_len_min_max": [min(self.output_lens), max(self.output_lens)] if self.output_lens else None,
        }


def sample_lengths(num: int, mean_len: int, range_ratio: float, rng: np.random.Generator) -> list[int]:
    """`mean_len` each when range_ratio is 0, else uniform integers in mean·[1 − r, 1 + r] (at least 1)."""
    low = max(1, round(mean_len * (1 - range_ratio)))
    high = max(low, round(mean_len * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num).tolist()


def random_token_ids(length: int, vocab_size: int, rng: np.random.Generator, exclude: Sequence[int] = ()) -> list[int]:
    """Uniform ids in [0, vocab_size) other than `exclude` (special tokens, which would act as markers)."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude), dtype=np.int64))
    return rng.choice(allowed, size=length).tolist()


def build_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    range_ratio: float = 0.0,
    exclude_ids: Sequence[int] = (),
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
) -> Workload:
    """`shared_prefix_len` > 0 puts one of `num_prefixes` common prefixes (a system prompt,
    say) before each request's own `input_len` tokens, round robin, so the prefix cache
    has something to find."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(num_requests, input_len, range_ratio, rng)
    out_lens = sample_lengths(num_requests, output_len, range_ratio, rng)
    prefixes = [random_token_ids(shared_prefix_len, vocab_size, rng, exclude_ids) for _ in range(num_prefixes)]
    prompts = [
        (prefixes[i % num_prefixes] if shared_prefix_len else []) + random_token_ids(n, vocab_size, rng, exclude_ids)
        for i, n in enumerate(in_lens)
    ]
    return Workload(prompts, out_lens)
