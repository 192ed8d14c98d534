"""One computed figure with its formula: what `--explain` prints and `--json` emits.

Values are held in base units (bytes, seconds, FLOPs, requests/s); `num` writes a
number for a substituted formula, `show` writes a value for a reader (GB and GiB side
by side, since the seed insists on keeping the two apart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
GIB = 2**30
KIB = 2**10


@dataclass(frozen=True)
class Quantity:
    key: str  # stable JSON key, e.g. "kv_bytes_per_position"
    label: str  # what a reader sees in the table
    value: float | int | str | bool | None
    unit: str = ""  # B, B/s, s, FLOP, tok/s, req/s, USD/tok, … ("" for a pure number)
    formula: str = ""  # the seed's formula in its symbols
    substituted: str = ""  # the same formula with this plan's numbers put in
    note: str = ""  # a reading taken, or why a value is n/a

    def as_json(self, section: str) -> dict:
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = None if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return {
            "section": section,
            "label": self.label,
            "value": value,
            "unit": self.unit,
            "formula": self.formula,
            "substituted": self.substituted,
            "note": self.note,
        }


def num(x: float | int) -> str:
    """A number as written inside a substituted formula: exact, short, no thousands commas.

    Large values use a mantissa-exponent form (4.375e9, 1.6777216e8) that keeps every
    significant digit the seed states, so a reader can check the arithmetic by hand.
    """
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if not math.isfinite(x):
        return "∞" if x > 0 else ("-∞" if x < 0 else "NaN")
    if x == 0:
        return "0"
    magnitude = abs(x)
    if 1e-3 <= magnitude < 1e6:
        if float(x).is_integer():
            return str(int(x))
        return f"{x:.6g}"
    mantissa, exponent = f"{x:.9e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def _bytes(x: float) -> str:
    if x < 1024:
        return f"{x:,.0f} B"
    if x < 1e6:
        return f"{x:,.0f} B ({x / KIB:.4g} KiB)"
    if x < 1e9:
        return f"{x / 1e6:.9g} MB ({x / 2**20:.6g} MiB)"
    return f"{x / GB:.9g} GB ({x / GIB:.6g} GiB)"


def _seconds(x: float) -> str:
    if x == 0:
        return "0 s"
    if abs(x) < 1e-3:
        return f"{x * 1e6:.4g} µs"
    if abs(x) < 1:
        return f"{x * 1e3:.5g} ms"
    return f"{x:.5g} s"


def show(value: float | int | str | bool | None, unit: str = "") -> str:
    """A value as a reader wants it: bytes in GB and GiB, seconds in ms where small."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return "∞" if value > 0 else "n/a"
    if unit == "B":
        return _bytes(value)
    if unit == "B/s":
        return f"{value / GB:.6g} GB/s"
    if unit == "s":
        return _seconds(value)
    if unit == "FLOP":
        return f"{value:.6g} FLOP"
    if isinstance(value, int):
        text = f"{value:,}"
    elif abs(value) >= 1e6 or (value != 0 and abs(value) < 1e-3):
        text = f"{value:.6g}"
    else:
        text = f"{value:,.6g}" if abs(value) < 1e5 else f"{value:,.1f}"
    return f"{text} {unit}".rstrip()


@dataclass(frozen=True)
class Section:
    """A titled group of quantities: one part of `kvserve plan run`'s report."""

    key: str
    title: str
    quantities: list[Quantity]
