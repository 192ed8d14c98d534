"""PNG plots of benchmark results (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_PERCENTILES = (("median", "p50", "-o"), ("p90", "p90", "--s"), ("p99", "p99", ":^"))


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display), imported only when a plot is asked
    for: the import costs a bench process ~20 MB of the peak RSS it reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve(results: dict[str, Any], path: str | Path) -> None:
    """Latency percentiles against achieved output throughput, one point per request rate."""
    plt = _pyplot()
    sweep = [row for row in results["sweep"] if row["completed"]]
    throughput = [row["output_throughput_tok_per_s"] for row in sweep]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end"))):
        for stat, label, style in _PERCENTILES:
            values = [row[key][stat] for row in sweep]
            if any(v is not None for v in values):
                ax.plot(throughput, values, style, label=label)
        for row, x in zip(sweep, throughput):
            if row[key]["p99"] is not None:
                ax.annotate(f"{row['request_rate']}", (x, row[key]["p99"]), textcoords="offset points", xytext=(3, 4), fontsize=7)
        ax.set_title(f"{title} (labels: request rate, req/s)")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['model']} at {results['url']}: "
                 f"{results['workload']['input_len']} in / {results['workload']['output_len']} out")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: dict[str, Any], path: str | Path) -> None:
    """Achieved tokens/s beside the roofline, for decode and each prefill length."""
    plt = _pyplot()
    d = results["decode"]
    labels = ["decode"] + [f"prefill {p['prompt_len']}" for p in results["prefill"]]
    achieved = [d["tok_per_s"]] + [p["tok_per_s"] for p in results["prefill"]]
    ceiling = [d["roofline_tok_per_s"]] + [p["roofline_tok_per_s"] for p in results["prefill"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ceiling, width=0.4, label="roofline", color="#bbbbbb")
    bars = ax.bar([i + 0.2 for i in x], achieved, width=0.4, label="kvserve", color="#3a6ea5")
    for bar, a, c in zip(bars, achieved, ceiling):
        ax.annotate(f"{100 * a / c:.0f}%", (bar.get_x() + bar.get_width() / 2, a), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log)")
    ax.set_title(f"{results['model']['name']} batch 1, {results['model']['dtype']}: achieved vs roofline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(results: dict[str, Any], path: str | Path) -> None:
    """Output and total tokens/s of each engine that ran."""
    plt = _pyplot()
    engines = [r for r in results["engines"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(engines))
    ax.bar([i - 0.2 for i in x], [r["output_tok_per_s"] for r in engines], width=0.4, label="output tok/s")
    ax.bar([i + 0.2 for i in x], [r["total_tok_per_s"] for r in engines], width=0.4, label="total tok/s")
    ax.set_xticks(list(x), [r["engine"] for r in engines])
    ax.set_ylabel("tokens/s")
    w = results["workload"]
    ax.set_title(f"{w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
