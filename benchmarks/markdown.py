"""Markdown tables from the JSON a benchmark wrote, for BENCHMARKS.md.

    python -m benchmarks.markdown FILE.json [FILE.json …]

Each table is printed with the command that produced it and where it ran, so after a
re-measurement the document is refreshed by pasting this output, never by hand-copying
numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _n(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _provenance(data: dict[str, Any], path: str) -> list[str]:
    m = data["machine"]
    where = f"{m['cpu']}, {m['logical_cpus']} CPUs, {m['torch_threads']} torch threads, torch {m['torch']}"
    if m.get("gpu"):
        where += f", {m['gpu']}"
    before = m.get("before_run") or {}
    load = ""
    if before.get("cpu_busy_fraction") is not None:
        load = f"; CPUs {100 * before['cpu_busy_fraction']:.0f}% busy just before the run"
    during = m.get("during_run") or {}
    if during.get("others_cpu_fraction") is not None:
        # against a local server, the server itself is one of the "other processes"
        who = "the server and any other process" if data["benchmark"] == "serve" else "other processes"
        load += f", {who} took {100 * during['others_cpu_fraction']:.0f}% of the CPUs during it"
    return [
        f"Command: `{data['command'] or '(run in-process; args in the JSON)'}`  ",
        f"Measured {data['measured_at']} at commit `{data['commit']}` on {where}{load}. Figures: `{path}`.",
        "",
    ]


def latency_table(r: dict[str, Any]) -> list[str]:
    d, machine = r["decode"], r["machine"]
    lines = [
        f"Model {r['model']['name']} ({r['model']['params'] / 1e6:.1f}M params, {r['model']['dtype']}, {r['model']['device']}); "
        f"measured in the same run: memory read {machine['read_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"bf16 GEMM {machine['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s.",
        "",
        "| phase | tokens | tok/s | roofline tok/s | of roofline | median time | roofline basis |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| decode, batch 1 | context {d['context_len_start']}, {d['steps']} steps | {_n(d['tok_per_s'])} | "
        f"{_n(d['roofline_tok_per_s'])} | {100 * d['fraction_of_roofline']:.0f}% | {_n(d['step_ms']['median'], 2)} ms/step | "
        f"{d['bytes_per_step'] / 1e6:.0f} MB read per step |",
    ]
    if "read_share" in d:  # each step between two reads of its bytes (kvserve.bench.latency.measure_read_share)
        rs = d["read_share"]
        lines.append(f"| decode, each step between two reads of its bytes | {rs['steps']} steps | "
                     f"{_n(rs['decode_bytes_per_s_median'] / d['bytes_per_step'])} | "
                     f"{_n(rs['read_bytes_per_s_median'] / d['bytes_per_step'])} | {100 * rs['median']:.0f}% | "
                     f"quartiles {100 * rs['p25']:.0f}-{100 * rs['p75']:.0f}% | the reads' median {rs['read_bytes_per_s_median'] / 1e9:.1f} GB/s |")
    for p in r["prefill"]:
        lines.append(
            f"| prefill | {p['prompt_len']} | {_n(p['tok_per_s'])} | {_n(p['roofline_tok_per_s'])} | "
            f"{100 * p['fraction_of_roofline']:.0f}% | {_n(p['time_ms']['median'])} ms | {p['flops']['total'] / 1e9:.1f} GFLOP |"
        )
    return lines


def throughput_table(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    lines = [
        f"{w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, "
        f"{r['model']} {r['dtype']}, EOS ignored.",
        "",
        "| engine | output tok/s | total tok/s | req/s | elapsed s | peak RSS MiB | kvserve × |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in r["engines"]:
        if "error" in e:
            lines.append(f"| {e['engine']} | could not run: {e['error']} | | | | | |")
            continue
        ratio = r["ratios"].get(e["engine"])
        lines.append(
            f"| {e['engine']} | {_n(e['output_tok_per_s'])} | {_n(e['total_tok_per_s'])} | {_n(e['requests_per_s'], 2)} | "
            f"{_n(e['elapsed_s'], 1)} | {_n(e['peak_rss_mib'], 0)} | {'' if ratio is None else f'{ratio:.2f}'} |"
        )
    ours = r["engines"][0]
    if "prefix_cache_hit_rate" in ours:
        lines += [
            "",
            f"kvserve: {ours['steps']} steps, {ours['preemptions']} preemptions, prefix-cache hit rate "
            f"{100 * ours['prefix_cache_hit_rate']:.1f}% (tokens found / tokens looked up), TTFT median "
            f"{_n(ours['ttft_ms']['median'], 0)} ms, TPOT median {_n(ours['tpot_ms']['median'])} ms.",
        ]
    rounds = r.get("round_ratios", [])
    if rounds:
        lines += ["", f"The engines ran in turn, {len(rounds)} rounds; each row above is that engine's fastest round."]
        for peer in r["ratios"]:
            per_round = [f"{x[peer]:.2f}" for x in rounds if peer in x]
            elapsed = [_n(s, 1) for s in next(e for e in r["engines"] if e["engine"] == peer).get("elapsed_s_rounds", [])]
            lines.append(f"- kvserve × {peer}, round by round: {', '.join(per_round)} ({peer} elapsed s: {', '.join(elapsed)})")
        ours_elapsed = [_n(s, 1) for s in ours.get("elapsed_s_rounds", [])]
        lines.append(f"- kvserve elapsed s, round by round: {', '.join(ours_elapsed)}")
        if r.get("round_read_gb_s"):
            lines.append("- memory read (512 MiB summed) before each round: "
                         + ", ".join(f"{x:.1f}" for x in r["round_read_gb_s"]) + " GB/s")
    return lines


def serve_table(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    slo = ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in r["slo_ms"].items() if v is not None)
    lines = [
        f"{r['model']} at {r['url']}; {w['num_prompts']} requests per rate, {w['input_len']} in / {w['output_len']} out"
        + (f"; goodput SLOs: {slo}" if slo else "") + ".",
        "",
        "| rate req/s | done | req/s | out tok/s | TTFT ms mean/p50/p90/p99 | TPOT ms mean/p50/p90/p99 | ITL ms p50/p99 | E2E ms p50/p99 | goodput req/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def four(s):
        return "/".join(_n(s[k], 0 if (s[k] or 0) >= 100 else 1) for k in ("mean", "median", "p90", "p99"))

    for row in r["sweep"]:
        rate = f"{row['request_rate']}" + (f" (≤{row['max_concurrency']})" if row.get("max_concurrency") else "")
        lines.append(
            f"| {rate} | {row['completed']}/{row['completed'] + row['failed']} | {_n(row['request_throughput_req_per_s'], 2)} | "
            f"{_n(row['output_throughput_tok_per_s'])} | {four(row['ttft_ms'])} | {four(row['tpot_ms'])} | "
            f"{_n(row['itl_ms']['median'])}/{_n(row['itl_ms']['p99'])} | {_n(row['e2e_ms']['median'], 0)}/{_n(row['e2e_ms']['p99'], 0)} | "
            f"{_n(row.get('goodput_req_per_s'), 2)} |"
        )
    return lines


def quality_table(r: dict[str, Any]) -> list[str]:
    from kvserve.bench.quality import quality_table as table  # one renderer, beside the measurement

    return table(r)


TABLES = {"latency": latency_table, "throughput": throughput_table, "serve": serve_table, "quality": quality_table}


def render(path: str) -> str:
    data = json.loads(Path(path).read_text())
    return "\n".join(_provenance(data, path) + TABLES[data["benchmark"]](data["results"])) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print("\n".join(render(p) for p in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
