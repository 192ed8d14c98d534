"""`kvserve sim --plot`: latency against arrival rate (a sweep), or latency distributions (one rate)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_plot(path: str, results: list[tuple[float, dict, list]]) -> Path:
    """`results`: (rate, summary, traces) per simulated rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if len(results) > 1:
        rates = [r for r, _, _ in results]
        for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
            for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
                ax.plot(rates, [s[key][stat] for _, s, _ in results], style, label=stat)
            ax.set_xlabel("arrival rate, req/s")
            ax.set_ylabel(f"{title}, ms")
            ax.set_title(f"{title} against arrival rate (simulated)")
            ax.grid(alpha=0.3)
            ax.legend()
    else:
        _, _, traces = results[0]
        for ax, attr, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
            values = np.sort([getattr(t, attr) * 1e3 for t in traces if getattr(t, attr) is not None])
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size)
            ax.set_xlabel(f"{title}, ms")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{title} distribution (simulated)")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
