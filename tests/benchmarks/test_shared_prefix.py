"""`python -m benchmarks.shared_prefix_kernel` runs and prints each workload's times, rates
and the GEMM roofline beside them (a smoke test with 2 layers; the figures are for humans)."""

from __future__ import annotations

import re

import pytest

from benchmarks import shared_prefix_kernel
from kvserve.kernels import cpu_ops


@pytest.mark.skipif(cpu_ops() is None, reason="CPU kernels unavailable here")
def test_kernel_bench_prints_times_rates_and_the_roofline(capsys):
    shared_prefix_kernel.main(["--layers", "2", "--repeats", "1", "--private", "20"])
    out = capsys.readouterr().out
    assert re.search(r"roofline: torch bf16 GEMM 2048\^3 [\d.]+ GMAC/s", out)
    assert out.count("speed-up") == 2 and out.count("GMAC/s") >= 6
    errors = [float(x) for x in re.findall(r"max \|plain - shared\| ([\d.e+-]+)", out)]
    assert errors and max(errors) < 1e-2  # the two paths agree within bf16 rounding


def test_crossover_bench_prints_a_ratio_per_cell(tiny_model_dirs, capsys):
    from benchmarks import shared_prefix_crossover

    shared_prefix_crossover.main(["--model", tiny_model_dirs["llama-hd64"], "--requests", "2,3", "--prefix-lens", "32",
                                  "--steps", "4"])  # fmt: skip
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("2", "32"), ("3", "32")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
