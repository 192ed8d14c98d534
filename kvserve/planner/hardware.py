"""Chip figures: presets, the `local` chip measured by `kvserve plan calibrate`, validation.

A chip is what the seed's arithmetic needs from hardware: HBM capacity `H_mem`, HBM
bandwidth `β`, peak matrix FLOP/s `C`, a price `c` per chip-second, and the link used by
tensor-parallel collectives (bandwidth, start-up latency `α`). Figures are budgets for
estimates, not measured throughput (the seed says so of its own).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.paths import cache_root
from kvserve.planner import checks

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float  # H_mem
    hbm_bytes_per_s: float  # β
    peak_flops_per_s: float  # C, dense bf16
    cost_usd_per_chip_s: float | None  # c; None where no price is known
    link_bytes_per_s: float  # one-way bandwidth of the link a TP collective uses
    link_latency_s: float  # α, start-up time of one collective
    note: str = ""

    def __post_init__(self) -> None:
        checks.positive("hbm_bytes", self.hbm_bytes)
        checks.positive("hbm_bytes_per_s", self.hbm_bytes_per_s)
        checks.positive("peak_flops_per_s", self.peak_flops_per_s)
        if self.cost_usd_per_chip_s is not None:
            checks.non_negative("cost_usd_per_chip_s", self.cost_usd_per_chip_s)
        checks.positive("link_bytes_per_s", self.link_bytes_per_s)
        checks.non_negative("link_latency_s", self.link_latency_s)


PRESETS: dict[str, Chip] = {
    "seed": Chip(
        "seed", 16e9, 8.2e11, 1.97e14, 1.2 / SECONDS_PER_HOUR, 4.5e10, 1e-6,
        note="the seed's chapter-8 budget (TPU v5e): 16 GB, β=8.2e11 B/s, C=1.97e14 FLOP/s; "
        "USD 1.20/h and ICI 4.5e10 B/s one-way from the book",
    ),
    "h100": Chip(
        "h100", 80e9, 3.35e12, 9.89e14, 10.8 / SECONDS_PER_HOUR, 4.5e11, 3e-6,
        note="H100 SXM: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16; USD 10.80/h from the book's "
        "table (Google Cloud, Feb 2025); NVLink 450 GB/s one-way; α is a rough guess",
    ),
    "h200": Chip(
        "h200", 141e9, 4.8e12, 9.89e14, None, 4.5e11, 3e-6,
        note="H200 SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16; no price given "
        "(pass --chip-cost-usd-per-hour); NVLink 450 GB/s one-way; α is a rough guess",
    ),
}

LOCAL = "local"


def local_chip_path() -> Path:
    """Where `calibrate` writes, in kvserve's cache directory (`kvserve.paths.cache_root`)."""
    return cache_root() / "local_chip.json"


def save_local_chip(chip: Chip, extra: dict | None = None) -> Path:
    path = local_chip_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(chip), **(extra or {})}, indent=2) + "\n")
    return path


def load_local_chip() -> Chip:
    path = local_chip_path()
    if not path.exists():
        raise ConfigError("chip", f"no local measurement at {path}; run `kvserve plan calibrate` first")
    try:
        data = json.loads(path.read_text())
        fields = {k: data[k] for k in Chip.__dataclass_fields__ if k in data}
        return Chip(**fields)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError("chip", f"{path} is not a calibrate result ({exc}); rerun `kvserve plan calibrate`") from exc


def get_chip(name: str) -> Chip:
    if name == LOCAL:
        return load_local_chip()
    if name not in PRESETS:
        raise ConfigError("chip", f"unknown preset {name!r}; use one of {', '.join([*PRESETS, LOCAL])}")
    return PRESETS[name]


def with_overrides(chip: Chip, **fields) -> Chip:
    """The chip with the given (non-None) figures replaced, revalidated."""
    changes = {k: v for k, v in fields.items() if v is not None}
    return replace(chip, **changes) if changes else chip
