"""`--plot FILE`: step time and throughput against batch, and the disaggregation stage rates.

One PNG, three panels. The step-time curve is the staged model recomputed at every B
(projection max, KV read, exchange), with the step target, the capacity limit, the
critical batch B* and the chosen decode batch marked.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.planner.plan import Plan

# beyond this the curve says nothing new, and a tiny model's capacity can be millions
MAX_PLOTTED_BATCH = 4096


def _batch_range(plan: Plan) -> range:
    d = plan.derived
    cap, b_star = d.capacity_batch(), plan["critical_batch"]
    wanted = max(16, 2 * d.decode_batch, int(1.25 * min(cap, MAX_PLOTTED_BATCH)), int(1.25 * b_star))
    top = min(wanted, MAX_PLOTTED_BATCH)
    return range(1, top + 1, max(1, top // 512))


def write_plot(plan: Plan, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.parent and not path.parent.exists():
        raise ConfigError("plot", f"directory {path.parent} does not exist")
    d, i = plan.derived, plan.inputs
    batches = list(_batch_range(plan))
    steps = [d.step(b) for b in batches]
    step_ms = [s.total_s * 1e3 for s in steps]
    projection_ms = [s.projection_s * 1e3 for s in steps]
    kv_ms = [s.kv_read_s * 1e3 for s in steps]
    tokens = [b / s.total_s for b, s in zip(batches, steps)]
    cap, b_star, chosen = d.capacity_batch(), plan["critical_batch"], d.decode_batch

    fig, (ax_t, ax_r, ax_d) = plt.subplots(1, 3, figsize=(17, 5))
    fig.suptitle(f"{i.model.name} on {i.num_chips}× {i.chip.name}, {i.kv_layout} layout, S={i.history_positions}")

    ax_t.plot(batches, step_ms, label="step time")
    ax_t.plot(batches, projection_ms, "--", label="projections max(2PB/C, W/β)")
    ax_t.plot(batches, kv_ms, ":", label="KV read")
    ax_t.axhline(i.step_target_s * 1e3, color="red", lw=1, label=f"target {i.step_target_s * 1e3:g} ms")
    ax_t.set(xlabel="batch B", ylabel="ms per decode step", title="Step time")

    ax_r.plot(batches, tokens, color="tab:green", label="tokens/s (system)")
    ax_r.set(xlabel="batch B", ylabel="tokens/s", title="Throughput")

    for ax in (ax_t, ax_r):
        if cap <= batches[-1]:
            ax.axvline(cap, color="black", lw=1, label=f"capacity B={cap}")
            ax.axvspan(cap, batches[-1], color="gray", alpha=0.12)  # does not fit in memory
        if b_star <= batches[-1]:
            ax.axvline(b_star, color="gray", ls="--", lw=1, label=f"critical B*={b_star:.1f}")
        ax.axvline(chosen, color="tab:purple", ls="-.", lw=1, label=f"decode batch B={chosen}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if cap > batches[-1]:
        ax_t.text(0.02, 0.02, f"capacity B={cap:,} is beyond the plotted range", transform=ax_t.transAxes, fontsize=8)

    rates = {"prefill": plan["prefill_rate_req_per_s"], "decode": plan["decode_rate_req_per_s"],
             "network": plan["network_rate_req_per_s"]}
    finite = {k: v for k, v in rates.items() if v != float("inf")}
    colors = ["tab:red" if k == plan["bottleneck"] else "tab:blue" for k in finite]
    ax_d.bar([f"{k}\n{v:.3g} req/s" for k, v in finite.items()], list(finite.values()), color=colors)
    ax_d.axhline(plan["target_rate_req_per_s"], color="black", ls="--", lw=1, label="target rate")
    ax_d.set(ylabel="requests/s", title=f"Disaggregation stage rates ({i.prefill_groups} prefill group(s))")
    ax_d.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
