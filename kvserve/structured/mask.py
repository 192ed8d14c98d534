"""The grammar's token masks applied to a step's logits, for the constrained rows only.

Masks are computed together (llguidance's executor spreads the matchers over threads,
outside the GIL) into one int32 bitmask, then applied with torch ops, no per-token Python:
each byte of the bitmask looks up its 8 tokens' additive bias (0 or -inf) in a 256-row
table (an embedding lookup) and the biases are added to the rows. Measured at batch 64,
vocab 49152, one thread: 2.4 ms, against 12 ms for unpacking to bool and `masked_fill_`
(torch's CPU masked_fill is slow). Tokens beyond the bitmask (a model vocabulary wider
than the tokenizer's) are disallowed.
"""

from __future__ import annotations

import threading
from typing import Sequence

import llguidance
import llguidance.torch as llt
import torch

from kvserve.structured.matcher import GrammarMatcher

_BITS = torch.arange(8, dtype=torch.uint8)
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def fill_bitmasks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab_size / 32)] int32: row i = the tokens matcher i allows next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
    if len(matchers) == 1:  # the executor's hand-off costs more than it saves for one
        matchers[0].fill_bitmask(bitmask, 0)
    else:
        llt.fill_next_token_bitmask_par(_get_executor(), [(m.ll_matcher, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 → [R, vocab_size] bool (True = allowed); bit j of word w is token 32w + j.
    For inspection and tests; the sampler adds `bitmask_to_bias` instead."""
    rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    bits = (as_bytes.unsqueeze(-1) >> _BITS) & 1  # [R, 4W, 8]
    allowed = bits.view(rows, -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((rows, vocab_size - width), dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


# byte value -> the additive bias of its 8 tokens (bit k set: token allowed, bias 0)
_BYTE_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()
_bias_tables: dict[torch.dtype, torch.Tensor] = {}


def bitmask_to_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[R, W] int32 → [R, vocab_size] additive bias: 0 where allowed, -inf elsewhere."""
    table = _bias_tables.get(dtype)
    if table is None:
        table = _bias_tables[dtype] = torch.zeros((256, 8), dtype=dtype).masked_fill_(~_BYTE_BITS, float("-inf"))
    rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int32)  # little-endian: token 8k + bit of byte k
    bias = torch.nn.functional.embedding(as_bytes, table).view(rows, -1)
    width = bias.shape[1]
    if width >= vocab_size:
        return bias[:, :vocab_size]
    pad = torch.full((rows, vocab_size - width), float("-inf"), dtype=dtype)
    return torch.cat([bias, pad], dim=1)


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]) -> None:
    """Set to -inf, in place, every token the grammar disallows in each constrained row
    (`rows` ascending, one matcher each); the other rows are not touched."""
    vocab = logits.shape[-1]
    # the bitmask at the grammar's own width (llguidance writes exactly that); the bias is
    # then trimmed or padded (disallowed) to the logits' width
    bias = bitmask_to_bias(fill_bitmasks(matchers, matchers[0].vocab_size), vocab, logits.dtype)
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(list(rows), dtype=torch.long), bias)
