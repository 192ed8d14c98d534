"""Each kernel family timed at several ISA levels in one process, the levels alternating.

    python -m benchmarks.kernel_levels [--levels avx2,avx512-vnni,avx512-bf16] [--rounds 5]
        [--threads N] [--only NAME,...]

The question: at which shapes does a level gain over the one below it, per op family (the
every-CPU issue's "a family with nothing to gain at a level uses the next lower one"). Each
case runs every level's build on the same tensors, round by round in turn (A B C A B C ...),
and prints the median time per call of each level and its ratio to the first level named.
Shapes are the Llama-3.2-1B shape's (hidden 2048, 8 KV heads of 64, MLP 8192) unless a case
says otherwise. Each case states in its name what it times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.kernels import cpu_ops
from kvserve.kernels.isa import runnable_levels


def _timeit(fn, min_s: float = 0.2) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def _quant_segments(ops, n: int, k: int, fmt: str):
    from kvserve.model.quant_formats import KIND_CODES, quantize_int4_blocks, quantize_q8_blocks

    w = torch.randn(n, k) * 0.05
    q = quantize_q8_blocks(w, "bench") if fmt == "q8_0" else quantize_int4_blocks(w)
    return [ops.QuantSegment(codes=s.codes, scales=s.scales, mins=s.mins, format=KIND_CODES[s.kind]) for s in q.segments]


def _decode_case(batch, ctx, n_q, n_kv, hd, dtype=torch.bfloat16, bs=16):
    g = torch.Generator().manual_seed(0)
    blocks = batch * (-(-ctx // bs)) + 1
    k = torch.randn(blocks, bs, n_kv, hd, generator=g).to(dtype)
    v = torch.randn(blocks, bs, n_kv, hd, generator=g).to(dtype)
    q = torch.randn(batch, n_q, hd, generator=g).to(dtype)
    per = -(-ctx // bs)
    tables = torch.randperm(blocks - 1, generator=g)[: batch * per].view(batch, per).to(torch.int32) + 1
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return q, k, v, tables, lens


def _prefill_case(m, s0, n_q, n_kv, hd, bs=16):
    g = torch.Generator().manual_seed(0)
    blocks = -(-(s0 + m) // bs) + 1
    k = torch.randn(blocks, bs, n_kv, hd, generator=g).bfloat16()
    v = torch.randn(blocks, bs, n_kv, hd, generator=g).bfloat16()
    q = torch.randn(m, n_q, hd, generator=g).bfloat16()
    slots = torch.arange(bs, bs + s0 + m, dtype=torch.long)
    segs = torch.tensor([[0, m, s0, 0]], dtype=torch.long)
    return q, k, v, slots, segs


def cases(ops_by_level: dict):
    """(name, {level: callable}) for each case."""
    any_ops = next(iter(ops_by_level.values()))
    out = []
    for rows in (1, 8, 64, 512):
        x = torch.randn(rows, 2048).bfloat16()
        w = (torch.randn(8192, 2048) * 0.05).bfloat16()
        packed = any_ops.amx_pack_weight(w)
        out.append((f"gemm_vnni bf16 {rows}x2048 -> 8192", {lv: (lambda o=o, x=x, packed=packed: o.gemm_vnni(x, packed)) for lv, o in ops_by_level.items()}))
    for fmt in ("q4_1", "q8_0"):
        for rows in (1, 16, 64, 512):  # avx2 reads its 8-bit panel from 48 rows
            x = torch.randn(rows, 2048).bfloat16()
            fns = {}
            for lv, o in ops_by_level.items():
                segs = _quant_segments(o, 8192, 2048, fmt)
                fns[lv] = lambda o=o, segs=segs, x=x: o.quant_linear(x, segs, None, False)
            out.append((f"quant_linear {fmt} {rows}x2048 -> 8192", fns))
    for batch, ctx in ((1, 512), (1, 4096), (64, 256)):
        q, k, v, t, lens = _decode_case(batch, ctx, 32, 8, 64)
        out.append((f"decode_attention bf16 B={batch} ctx={ctx} 32/8x64",
                    {lv: (lambda o=o, a=(q, k, v, t, lens): o.paged_decode_attention(*a, 0.125)) for lv, o in ops_by_level.items()}))
    for m, s0 in ((512, 0), (64, 2048)):
        q, k, v, slots, segs = _prefill_case(m, s0, 32, 8, 64)
        outb = torch.empty_like(q)
        out.append((f"prefill_attention m={m} S0={s0} 32/8x64",
                    {lv: (lambda o=o, a=(q, k, v, slots, segs), outb=outb: o.paged_prefill_attention(*a, 0.125, outb)) for lv, o in ops_by_level.items()}))
    for n, plen in ((16, 2048), (64, 1024)):
        q, k, v, _, _ = _decode_case(1, plen, 32, 8, 64)
        qn = torch.randn(n, 32, 64).bfloat16()
        blocks = torch.arange(1, plen // 16 + 1, dtype=torch.int32)
        out.append((f"shared_prefix_attention n={n} prefix={plen} 32/8x64",
                    {lv: (lambda o=o, a=(qn, k, v, blocks, plen): o.shared_prefix_attention(*a, 0.125)) for lv, o in ops_by_level.items()}))
    x = torch.randn(512, 2048).bfloat16()
    wn = torch.randn(2048).bfloat16()
    out.append(("rms_norm 512x2048", {lv: (lambda o=o: o.rms_norm(x, wn, 1e-5, None)) for lv, o in ops_by_level.items()}))
    gu = torch.randn(512, 16384).bfloat16()
    out.append(("silu_and_mul 512x8192", {lv: (lambda o=o: o.silu_and_mul(gu)) for lv, o in ops_by_level.items()}))
    logits = torch.randn(64, 128256)
    out.append(("argmax_rows 64x128256 fp32", {lv: (lambda o=o: o.argmax_rows(logits)) for lv, o in ops_by_level.items()}))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default=",".join(lv for lv in runnable_levels() if lv not in ("avx512", "amx")))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated substrings of case names")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = [s for s in a.levels.split(",") if s]
    ops_by_level = {lv: cpu_ops(lv) for lv in levels}
    for lv, o in ops_by_level.items():
        if o is None:
            raise SystemExit(f"the {lv} kernels are not available")
    only = [s for s in a.only.split(",") if s]
    print(f"threads {torch.get_num_threads()}, levels {', '.join(levels)}; median ms per call of {a.rounds} rounds, ratio to {levels[0]}")
    for name, fns in cases(ops_by_level):
        if only and not any(s in name for s in only):
            continue
        times = {lv: [] for lv in levels}
        for _ in range(a.rounds):
            for lv in levels:
                times[lv].append(_timeit(fns[lv]) * 1e3)
        med = {lv: statistics.median(t) for lv, t in times.items()}
        cells = "  ".join(f"{lv} {med[lv]:8.3f} ({med[levels[0]] / med[lv]:4.2f}x)" for lv in levels)
        print(f"{name:45s} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
