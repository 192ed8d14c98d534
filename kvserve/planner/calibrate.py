"""`kvserve plan calibrate`: measure this machine as a `local` chip, in a few seconds.

β is the best rate of summing one large fp32 tensor (every byte read once, too large
for caches at the default size); C is the best rate of a square bf16 `torch.matmul`
(2n³ FLOPs). Best-of rather than mean, since the planner wants what the hardware can
reach, as the seed's chip figures are. The result is written as JSON to
`local_chip.json` in kvserve's cache directory (`kvserve.paths.cache_root`:
`$KVSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone

from kvserve.errors import ConfigError
from kvserve.planner import checks
from kvserve.planner.hardware import Chip, save_local_chip

DEFAULT_READ_BYTES = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}
DEFAULT_MATMUL_SIZE = {"cpu": 2048, "cuda": 8192}
LOCAL_LINK_LATENCY_S = 10e-6  # no interconnect measured: a rough figure for a copy through memory


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best_time_s(fn, torch, device: str, seconds: float, min_runs: int = 3) -> float:
    fn()  # warm-up: allocation, kernel selection, page faults
    _sync(torch, device)
    best, runs, deadline = float("inf"), 0, time.perf_counter() + seconds
    while runs < min_runs or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        _sync(torch, device)
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best


def measure_read_bytes_per_s(num_bytes: int, seconds: float, device: str = "cpu") -> float:
    import torch

    x = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32, device=device)
    return x.numel() * 4 / _best_time_s(x.sum, torch, device, seconds)


def measure_bf16_flops_per_s(size: int, seconds: float, device: str = "cpu") -> float:
    """The GEMM rate of bf16 inputs: bf16 matmuls where the device computes them natively; on a
    CPU whose oneDNN has no bf16 kernels (AVX2-only), fp32, which is what kvserve's kernels do
    there with bf16 weights (widened in registers). torch's bf16 fallback there is a scalar
    loop: timing it took minutes and measured nothing kvserve runs."""
    import torch

    from kvserve.kernels.isa import cpu_supports_bf16

    dtype = torch.bfloat16 if device != "cpu" or cpu_supports_bf16() else torch.float32
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    return 2 * size**3 / _best_time_s(lambda: a @ b, torch, device, seconds)


def memory_bytes(device: str) -> float:
    """Total memory the device can hold KV in: RAM on CPU, HBM on a GPU."""
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(
    device: str = "cpu", read_bytes: int | None = None, matmul_size: int | None = None,
    seconds: float = 1.0, cost_usd_per_hour: float | None = None, save: bool = True, collectives: bool = True,
) -> Chip:
    """Measure this machine as the `local` chip. `collectives`: also time a two-rank gloo
    AllReduce on this host (planner/collectives.py) for the link's α and bandwidth; without it
    the link is taken as the memory bandwidth with a rough α."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device", "CUDA is not available in this torch build or machine")
    elif device != "cpu":
        raise ConfigError("device", f"must be cpu or cuda[:N], got {device!r}")
    read_bytes = checks.integer("read_bytes", read_bytes or DEFAULT_READ_BYTES[kind], 4)
    matmul_size = checks.integer("matmul_size", matmul_size or DEFAULT_MATMUL_SIZE[kind], 1)
    checks.positive("seconds", seconds)
    if cost_usd_per_hour is not None:
        checks.non_negative("cost_usd_per_hour", cost_usd_per_hour)
    beta = measure_read_bytes_per_s(read_bytes, seconds, device)
    flops = measure_bf16_flops_per_s(matmul_size, seconds, device)
    link_bw, link_alpha = beta, LOCAL_LINK_LATENCY_S
    link_note = "link = memory bandwidth, α a rough figure"
    if collectives:
        from kvserve.planner.collectives import measure_allreduce

        fit = measure_allreduce()
        link_bw, link_alpha = fit.bytes_per_s, fit.latency_s
        link_note = (f"link: a two-rank gloo AllReduce on this host, fp32 [1..4096, 576], fitted α + κ·bytes/bandwidth "
                     f"({len(fit.samples)} sizes)")  # fmt: skip
    chip = Chip(
        "local", memory_bytes(device), beta, flops,
        None if cost_usd_per_hour is None else cost_usd_per_hour / 3600, link_bw, link_alpha,
        note=f"measured on {device} by `kvserve plan calibrate` ({read_bytes} B read, {matmul_size}² bf16 matmul); {link_note}",
    )
    if save:
        save_local_chip(chip, {"measured_at": datetime.now(timezone.utc).isoformat(), "device": device})
    return chip
