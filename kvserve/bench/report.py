"""Rich tables of each benchmark's figures, printed to the terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _console() -> Console:
    # rich assumes 80 columns when not writing to a terminal: too narrow for these tables in a log
    console = Console()
    return console if console.is_terminal else Console(width=180)


def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def print_latency(results: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    m, machine, d = results["model"], results["machine"], results["decode"]
    console.print(f"[bold]{m['name']}[/] {m['params'] / 1e6:.1f}M params, {m['dtype']} on {m['device']}; "
                  f"measured memory read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"bf16 GEMM {machine['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s")
    table = Table(title="batch-1 latency against the roofline")
    for col in ("phase", "tokens", "tok/s", "roofline tok/s", "of roofline", "time (median)", "bound by"):
        table.add_column(col, justify="left" if col in ("phase", "bound by") else "right")
    table.add_row("decode", f"ctx {d['context_len_start']}+{d['steps']}", _f(d["tok_per_s"]), _f(d["roofline_tok_per_s"]),
                  _pct(d["fraction_of_roofline"]), f"{_f(d['step_ms']['median'], 2)} ms/step",
                  f"{d['bytes_per_step'] / 1e6:.0f} MB read per step")
    for p in results["prefill"]:
        table.add_row("prefill", str(p["prompt_len"]), _f(p["tok_per_s"]), _f(p["roofline_tok_per_s"]),
                      _pct(p["fraction_of_roofline"]), f"{_f(p['time_ms']['median'])} ms",
                      f"{p['flops']['total'] / 1e9:.1f} GFLOP")
    console.print(table)
    if "read_share" in d:
        rs = d["read_share"]
        console.print(f"decode's share of the read bandwidth, each of {rs['steps']} steps between two reads of its "
                      f"{rs['bytes'] / 1e6:.0f} MB: median {_pct(rs['median'])} (quartiles {_pct(rs['p25'])}-{_pct(rs['p75'])}; "
                      f"reads {rs['read_bytes_per_s_median'] / 1e9:.1f} GB/s, decode {rs['decode_bytes_per_s_median'] / 1e9:.1f} GB/s)")
    if "experts" in d:
        e = d["experts"]
        console.print(f"mixture of experts: {e['experts_per_layer']:.1f} experts run per sparse layer per decode step, "
                      f"{e['expert_bytes_per_step'] / 1e6:.1f} MB of expert weights read per step "
                      f"(every expert: {e['all_experts_bytes_per_step'] / 1e6:.1f} MB; the step reads "
                      f"{d['bytes_per_step'] / 1e6:.0f} MB where a dense model of the same weights reads "
                      f"{e['dense_equivalent_bytes_per_step'] / 1e6:.0f} MB)")
    if "comm_ms_per_step" in d:
        comm = d["comm_ms_per_step"]
        console.print(f"tensor parallel, {d['tensor_parallel_size']} ranks, KV layout {d.get('kv_layout', 'heads')}: of {_f(d['step_ms']['median'], 2)} ms per decode "
                      f"step, collectives {sum(comm.values()):.2f} ms (" + ", ".join(f"{k} {v:.2f}" for k, v in comm.items())
                      + "; rank 0, waits for the other ranks included)")
    for note in results.get("notes", []):
        console.print(f"note: {note}")


def print_throughput(results: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    w = results["workload"]
    console.print(f"{w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens "
                  f"(input {w['input_len_min_max']}, output {w['output_len_min_max']})")
    table = Table(title="offline throughput")
    for col in ("engine", "output tok/s", "total tok/s", "req/s", "elapsed s", "peak RSS MiB", "kvserve ×"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    ratios = results.get("ratios", {})
    for r in results["engines"]:
        if "error" in r:
            table.add_row(r["engine"], "could not run", "", "", "", "", "")
            continue
        ratio = ratios.get(r["engine"])
        table.add_row(r["engine"], _f(r["output_tok_per_s"]), _f(r["total_tok_per_s"]), _f(r["requests_per_s"], 2),
                      _f(r["elapsed_s"], 2), _f(r["peak_rss_mib"], 0), "" if ratio is None else f"{ratio:.2f}")
    console.print(table)
    ours = results["engines"][0]
    console.print(f"kvserve: {ours['steps']} steps, {ours['preemptions']} preemptions, "
                  f"prefix-cache hit rate {100 * ours['prefix_cache_hit_rate']:.1f}%, "
                  f"TTFT median {_f(ours['ttft_ms']['median'], 0)} ms, TPOT median {_f(ours['tpot_ms']['median'], 1)} ms")
    if "kv_bytes_read_per_step" in ours:
        console.print(f"kvserve: KV read per step {ours['kv_bytes_read_per_step'] / 2**20:.2f} MiB "
                      f"(scanning each history alone: {ours['kv_bytes_read_per_step_without_sharing'] / 2**20:.2f} MiB, "
                      f"x{ours['kv_read_ratio']:.2f}); shared-prefix attention {ours['shared_prefix_attention']}, "
                      f"read once in {ours['shared_prefix_steps']} of {ours['steps']} steps")
    if "experts" in ours:
        e = ours["experts"]
        console.print(f"kvserve: mixture of experts, {e['experts_per_layer']:.1f} experts run per sparse layer per step, "
                      f"{e['expert_bytes_per_step'] / 1e6:.1f} MB of expert weights read per step "
                      f"(every expert: {e['all_experts_bytes_per_step'] / 1e6:.1f} MB)")
    if "decode_attention_ms_per_step" in ours:
        console.print(f"kvserve: decode attention {ours['decode_attention_ms_per_step']:.2f} ms per step "
                      f"(torch.profiler, {ours['decode_attention_steps']} decode steps)")
    ab = ours.get("decode_attention_ab")
    if ab and "auto" in ab and "off" in ab:
        on, off = ab["auto"]["decode_attention_ms_per_step"], ab["off"]["decode_attention_ms_per_step"]
        console.print(f"kvserve: steps alternating in one run: decode attention {off:.2f} ms per step read per request "
                      f"({ab['off']['decode_attention_steps']} steps), {on:.2f} ms with shared-prefix attention "
                      f"({ab['auto']['decode_attention_steps']} steps): x{off / on:.2f}")
    for peer in results.get("ratios", {}):
        per_round = [f"{r[peer]:.2f}" for r in results.get("round_ratios", []) if peer in r]
        if per_round:
            console.print(f"kvserve × {peer}, round by round: {', '.join(per_round)}")
    if results.get("round_read_gb_s"):
        console.print("memory read before each round: " + ", ".join(f"{x:.1f}" for x in results["round_read_gb_s"]) + " GB/s")
    for r in results["engines"]:
        for key in ("error", "note", "warning"):
            if key in r:
                console.print(f"{r['engine']}: {r[key]}")


def print_serve(results: dict[str, Any], console: Console | None = None) -> None:
    console = console or _console()
    console.print(f"{results['url']} model {results['model']}")
    table = Table(title="serving: latency (ms) mean / median / p90 / p99 at each request rate")
    for col in ("rate req/s", "done", "req/s", "out tok/s", "TTFT", "TPOT", "ITL", "E2E", "goodput req/s"):
        table.add_column(col, justify="right")

    def cell(s: dict) -> str:
        return "/".join(_f(s[k], 0 if (s[k] or 0) >= 100 else 1) for k in ("mean", "median", "p90", "p99"))

    for row in results["sweep"]:
        rate = row["request_rate"]
        if row.get("max_concurrency"):
            rate = f"{rate} (≤{row['max_concurrency']})"
        table.add_row(str(rate), f"{row['completed']}/{row['completed'] + row['failed']}",
                      _f(row["request_throughput_req_per_s"], 2), _f(row["output_throughput_tok_per_s"]),
                      cell(row["ttft_ms"]), cell(row["tpot_ms"]), cell(row["itl_ms"]), cell(row["e2e_ms"]),
                      _f(row.get("goodput_req_per_s"), 2))
    console.print(table)
    for row in results["sweep"]:
        for error in row["errors"]:
            console.print(f"rate {row['request_rate']}: {row['failed']} failed, e.g. {error}")
