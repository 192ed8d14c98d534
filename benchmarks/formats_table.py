"""One table of weight/KV formats from the JSON the benches wrote: for BENCHMARKS.md.

    python -m benchmarks.formats_table FILE.json …

Rows are keyed by the model file and the engine's format flags (`--quantization`,
`--kv-cache-dtype`, `--dtype`, `--cpu-isa`) recorded in each JSON; `kvserve bench latency` (with
`--compare-llama-cpp`) gives decode and prefill against llama.cpp, `kvserve bench
throughput` total tok/s and peak RSS, `kvserve bench quality` perplexity and KL against
its reference. A figure a row has no JSON for is a dash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.markdown import _n


def _key(data: dict[str, Any]) -> tuple[str, str]:
    args = data.get("args") or {}
    model = Path(args.get("model") or "SmolLM2-135M-Instruct.Q4_1.gguf").name
    fmt = f"quantization {args.get('quantization', 'auto')}"
    if args.get("kv_cache_dtype", "auto") != "auto":
        fmt += f", KV {args['kv_cache_dtype']}"
    if args.get("dtype", "auto") != "auto":
        fmt += f", dtype {args['dtype']}"
    if args.get("cpu_isa"):  # a forced kernel level: one file at two levels is two rows
        fmt += f", level {args['cpu_isa']}"
    return model, fmt


def _best(values: list[float]) -> float | None:
    return max(values) if values else None


def _latency(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lc = r.get("llama_cpp") or {}
    rounds = lc.get("rounds") or []
    ours_decode = [x["kvserve"]["decode_tok_per_s"] for x in rounds] or [r["decode"]["tok_per_s"]]
    out["decode"] = _best(ours_decode)
    # decode's share of the read bandwidth: step by step (latency.measure_read_share), and the
    # roofline's (the first round's mean rate over the best 1-second read before or after)
    out["read_share"] = (r["decode"].get("read_share") or {}).get("median")
    out["roofline_share"] = r["decode"].get("fraction_of_roofline")
    p512 = [p for p in r["prefill"] if p["prompt_len"] == 512]
    ours_prefill = [x["kvserve"]["prefill_tok_per_s"].get("512") for x in rounds if x["kvserve"]["prefill_tok_per_s"].get("512")]
    out["prefill"] = _best(ours_prefill) or (p512[0]["tok_per_s"] if p512 else None)
    if rounds:
        out["llama_decode"] = _best([x["llama.cpp"]["decode"]["tok_per_s"] for x in rounds])
        pre = [p["tok_per_s"] for x in rounds for p in x["llama.cpp"]["prefill"] if p["prompt_len"] == 512]
        out["llama_prefill"] = _best(pre)
    return out


def _throughput(r: dict[str, Any]) -> dict[str, Any]:
    ours = r["engines"][0]
    out = {"throughput": ours["total_tok_per_s"], "peak_rss": ours["peak_rss_mib"]}
    peers = [e for e in r["engines"][1:] if str(e.get("engine", "")).startswith("llama.cpp")]
    if peers:  # --compare-llama-cpp: llama-batched-bench on the same workload
        out["llama_throughput"] = peers[0]["total_tok_per_s"]
    return out


def _quality(r: dict[str, Any]) -> dict[str, Any]:
    return {"ppl": r["candidate"]["perplexity"], "ref_ppl": r["reference"]["perplexity"], "kl": r["kl"]["mean"],
            "greedy": r["greedy"]["prefix_agreement"], "ref": r["reference"]["label"]}  # fmt: skip


READERS = {"latency": _latency, "throughput": _throughput, "quality": _quality}


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}"


def _share(paired: float | None, roofline: float | None) -> str:
    if paired is None and roofline is None:
        return "—"
    return f"{'—' if paired is None else f'{paired:.2f}'} ({'—' if roofline is None else f'{roofline:.2f}'})"


def render(paths: list[str]) -> str:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    where = set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        reader = READERS.get(data["benchmark"])
        if reader is None:
            continue
        rows.setdefault(_key(data), {}).update(reader(data["results"]))
        m = data["machine"]
        where.add(f"{m['cpu']}, {m['logical_cpus']} CPUs, commit `{data['commit']}`")
    lines = [
        f"Measured on {'; '.join(sorted(where))}. Files: {', '.join(f'`{p}`' for p in paths)}.",
        "",
        "| model file | format flags | decode tok/s | llama.cpp | ratio | decode share of read, step by step (roofline) | "
        "prefill 512 tok/s | llama.cpp | ratio | "
        "64x128/128 total tok/s | llama-batched-bench | ratio | peak RSS MiB | perplexity (ref) | mean KL | greedy agreement |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (model, fmt), r in rows.items():
        ppl = "—" if r.get("ppl") is None else f"{r['ppl']:.3f} ({r['ref_ppl']:.3f})"
        kl = "—" if r.get("kl") is None else f"{r['kl']:.2e}"
        greedy = "—" if r.get("greedy") is None else f"{100 * r['greedy']:.0f}%"
        lines.append(
            f"| {model} | {fmt} | {_n(r.get('decode'))} | {_n(r.get('llama_decode'))} | {_ratio(r.get('decode'), r.get('llama_decode'))} | "
            f"{_share(r.get('read_share'), r.get('roofline_share'))} | "
            f"{_n(r.get('prefill'))} | {_n(r.get('llama_prefill'))} | {_ratio(r.get('prefill'), r.get('llama_prefill'))} | "
            f"{_n(r.get('throughput'))} | {_n(r.get('llama_throughput'))} | {_ratio(r.get('throughput'), r.get('llama_throughput'))} | "
            f"{_n(r.get('peak_rss'), 0)} | {ppl} | {kl} | {greedy} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    sys.stdout.write(render(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
