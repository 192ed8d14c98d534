"""Attention in parts: each part's softmax with its log-sum-exp, and the exact merge of two parts.

Softmax attention over keys split into disjoint parts is the merge of the parts' results
weighted by their log-sum-exps, in fp32. Shared-prefix attention (attention/shared_prefix_plan.py)
computes a shared level and a request's own suffix as separate parts and merges them here
(attention/reference.py); the C++ kernels merge by the same rule.
"""

from __future__ import annotations

import torch

def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [..., M, H] over k, v [..., S, H], computed explicitly in fp32:
    scores, their log-sum-exp, softmax @ V. `mask` (bool, True = visible) broadcasts to
    [..., M, S]; `softcap` (Gemma 2) caps the scores, cap · tanh(s / cap), before the softmax.
    Returns (out [..., M, H] fp32, lse [..., M] fp32); a row that sees nothing (S = 0 or all
    masked) has out 0 and lse -inf, the merge's identity."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if scores.shape[-1] == 0:  # logsumexp of nothing is -inf already; keep the shapes
        return scores.new_zeros((*scores.shape[:-1], v.shape[-1])), lse
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe.unsqueeze(-1))  # exp(-inf) = 0 in a row that sees nothing
    return torch.matmul(probs, v.float()), lse


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two parts of one softmax over disjoint keys → the whole: lse = log(e^a + e^b), out =
    (e^(a - lse)·out_a + e^(b - lse)·out_b), in fp32. out [..., H], lse [...]. An empty part
    (lse = -inf) contributes nothing; both empty gives out 0, lse -inf."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    lse = top + torch.log(total)  # log 0 = -inf where both are empty
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a.float() * (wa / denom).unsqueeze(-1)) + (out_b.float() * (wb / denom).unsqueeze(-1))
    return out, lse
