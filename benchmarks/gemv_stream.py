"""How fast batch-1 quant_linear streams cold weights, against torch.sum over the same bytes.

    python -m benchmarks.gemv_stream [--level LEVEL] [--format q4_0|q8_0] [--rounds 4]

The weights are a Llama-3.2-1B shape's 16 layers of projections (7 matrices a layer, distinct
tensors, so each call reads its weights from memory as a decode step does), one GEMV of one
row each per round; then `torch.sum` over a buffer of the same size. The ratio is the share of
the machine's read bandwidth the GEMV reaches, apart from the rest of a decode step. Threads:
OMP_NUM_THREADS (torch's and the kernels' alike).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.kernel_levels import _quant_segments
from kvserve.kernels import cpu_ops

SHAPES = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--level", default=None, help="kernel level (default: the chosen one)")
    p.add_argument("--format", choices=("q4_0", "q8_0"), default="q4_0")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    ops = cpu_ops(args.level)
    if ops is None:
        p.error("no CPU kernels on this machine (see the log line above)")
    mats = [(k, _quant_segments(ops, n, k, args.format)) for _ in range(args.layers) for n, k in SHAPES]
    nbytes = sum(s.codes.numel() * s.codes.element_size() + s.scales.numel() * 2 for _, segs in mats for s in segs)
    xs = {k: torch.randn(1, k).bfloat16() for k in {k for _, k in SHAPES}}
    buf = torch.ones(nbytes // 4)
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for k, segs in mats:
            ops.quant_linear(xs[k], segs, None, False)
        t_gemv = time.perf_counter() - t0
        t0 = time.perf_counter()
        buf.sum()
        t_sum = time.perf_counter() - t0
        print(f"{args.format} {nbytes / 1e6:.0f} MB: GEMVs {nbytes / t_gemv / 1e9:.1f} GB/s ({t_gemv * 1e3:.1f} ms), "
              f"torch.sum {nbytes / t_sum / 1e9:.1f} GB/s, ratio {t_sum / t_gemv:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
