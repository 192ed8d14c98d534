"""llama.cpp as a peer: `llama-bench` beside `kvserve bench latency`, `llama-batched-bench`
beside `kvserve bench throughput` (`--compare-llama-cpp DIR`).

DIR holds llama.cpp's binaries and shared libraries, as /work/shared/tools/build-llama-cpp.sh
leaves them (they run with LD_LIBRARY_PATH=DIR). llama.cpp reads the .gguf file itself, in
the file's own tensor types (Q4_1 for the default model), whatever --dtype / --quantization
kvserve runs: the comparison is of the two engines on one file, each in its own format.
Both get the same thread count (kvserve's torch threads).

The machine's memory bandwidth moves by the hour, so the engines take turns: kvserve,
llama.cpp, kvserve, llama.cpp (`--llama-cpp-rounds`, default 2), and each engine's best
round is compared, with every round's figures kept in the JSON.

Latency, matched to kvserve's settings as far as llama-bench allows:
- decode: `-p 0 -n DECODE_STEPS -d DECODE_CONTEXT_LEN+WARMUP_STEPS`: the depth is filled
  untimed, so the first timed token attends to as many positions as kvserve's first timed
  step (without `-d` in an older llama-bench, decode starts from an empty context; noted);
- prefill: `-p LEN,LEN,… -n 0`, one test per --prompt-lens length, `-r PREFILL_ITERS`.

Throughput: `llama-batched-bench -npp INPUT_LEN -ntg OUTPUT_LEN -npl NUM_PROMPTS`, all
requests at once with a context that holds them all; fixed lengths, random token ids, no
shared prefix (kvserve's --range-ratio and --shared-prefix-len have no counterpart there:
noted when set).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LLAMA_BENCH = "llama-bench"
BATCHED_BENCH = "llama-batched-bench"
TIMEOUT_S = 1800
BATCHED_BENCH_ATTEMPTS = 3


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class LlamaCpp:
    bin_dir: Path
    model: Path
    threads: int

    def env(self) -> dict[str, str]:
        ld = os.environ.get("LD_LIBRARY_PATH")
        return {**os.environ, "LD_LIBRARY_PATH": str(self.bin_dir) + (f":{ld}" if ld else "")}

    def argv(self, binary: str, args: list[str]) -> list[str]:
        return [str(self.bin_dir / binary), *args]

    def command(self, binary: str, args: list[str]) -> str:
        """The command line as a user would type it to rerun it."""
        return f"LD_LIBRARY_PATH={shlex.quote(str(self.bin_dir))} " + shlex.join(self.argv(binary, args))

    def run(self, binary: str, args: list[str], timeout_s: float = TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float | None]:
        """Run a binary to completion: (its result, its peak RSS in MiB as last read from
        /proc while it ran; None if it ended before the first read)."""
        import threading

        proc = subprocess.Popen(self.argv(binary, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env())
        peak: list[float | None] = [None]
        status = Path(f"/proc/{proc.pid}/status")

        def watch() -> None:
            while proc.poll() is None:
                try:
                    for line in status.read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak[0] = int(line.split()[1]) / 1024  # kB
                except (OSError, ValueError, IndexError):
                    pass
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err = (err or "") + f"\nkilled after {timeout_s:.0f} s"
        watcher.join(timeout=1)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak[0]


def find(bin_dir: str | None, model: str | None, binary: str, threads: int) -> tuple[LlamaCpp | None, str | None]:
    """(the peer, None), or (None, why the comparison is skipped)."""
    from kvserve.errors import KVServeError
    from kvserve.model.loader import resolve_model

    try:
        _, path = resolve_model(model)
    except KVServeError as exc:
        return None, str(exc)
    if path.suffix != ".gguf":
        return None, f"the model {path} is not a .gguf file (llama.cpp reads GGUF only)"
    directory = Path(bin_dir).expanduser()
    if not directory.is_dir():
        return None, f"{directory} is not a directory"
    exe = directory / binary
    if not exe.is_file() or not os.access(exe, os.X_OK):
        return None, f"{directory} has no executable {binary} (build it with /work/shared/tools/build-llama-cpp.sh)"
    return LlamaCpp(directory.resolve(), path.resolve(), threads), None


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": reason}


def weight_format(path: Path) -> str | None:
    """The tensor type most of a GGUF's matrices are stored in (e.g. Q4_1), from its header."""
    from collections import Counter

    try:
        from kvserve.model.gguf_metadata import open_gguf

        counts = Counter(t.tensor_type.name for t in open_gguf(path).tensors if len(t.shape) > 1)
    except Exception:  # a name for a report only
        return None
    return counts.most_common(1)[0][0] if counts else None


def _error(proc: subprocess.CompletedProcess) -> str:
    lines = [l for l in (proc.stderr or "").strip().splitlines() if l.strip()] or ["no output"]
    return f"exited with {proc.returncode}: {lines[-1][:300]}"


# ---- latency: llama-bench ---------------------------------------------------------------


def supports_depth(lc: LlamaCpp) -> bool:
    proc, _ = lc.run(LLAMA_BENCH, ["--help"], timeout_s=60)
    return "--n-depth" in (proc.stdout or "") + (proc.stderr or "")


def _llama_bench_json(lc: LlamaCpp, args: list[str]) -> list[dict[str, Any]]:
    proc, _ = lc.run(LLAMA_BENCH, args)
    if proc.returncode:
        raise RuntimeError(f"{LLAMA_BENCH} {_error(proc)}")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"{LLAMA_BENCH} printed no JSON: {(proc.stdout or '').strip()[:200]!r}") from None


def llama_bench_args(lc: LlamaCpp, settings, depth: bool) -> tuple[list[str], list[str]]:
    """(decode arguments, prefill arguments) of llama-bench for these latency settings."""
    common = ["-m", str(lc.model), "-t", str(lc.threads), "-o", "json"]
    decode = [*common, "-p", "0", "-n", str(settings.decode_steps), "-r", str(settings.prefill_iters)]
    if depth:
        decode += ["-d", str(settings.decode_context_len + settings.decode_warmup_steps)]
    prefill = [*common, "-p", ",".join(map(str, settings.prompt_lens)), "-n", "0", "-r", str(settings.prefill_iters)]
    return decode, prefill


def run_llama_bench(lc: LlamaCpp, settings, depth: bool) -> dict[str, Any]:
    decode_args, prefill_args = llama_bench_args(lc, settings, depth)
    try:
        (dec,) = _llama_bench_json(lc, decode_args)
        pre = _llama_bench_json(lc, prefill_args)
    except (RuntimeError, ValueError) as exc:
        return {"error": str(exc)}
    return {
        "decode": {"n_gen": dec["n_gen"], "depth": dec.get("n_depth", 0), "tok_per_s": dec["avg_ts"],
                   "stddev_tok_per_s": dec["stddev_ts"], "samples_tok_per_s": dec.get("samples_ts")},
        "prefill": [{"prompt_len": p["n_prompt"], "tok_per_s": p["avg_ts"], "stddev_tok_per_s": p["stddev_ts"],
                     "samples_tok_per_s": p.get("samples_ts")} for p in pre],
        "model_type": dec.get("model_type"),
        "build_commit": dec.get("build_commit"),
        "n_threads": dec.get("n_threads"),
        "n_batch": dec.get("n_batch"),
        "n_ubatch": dec.get("n_ubatch"),
        "type_k": dec.get("type_k"),
    }


def _kvserve_figures(decode: dict[str, Any], prefill: list[dict[str, Any]]) -> dict[str, Any]:
    return {"decode_tok_per_s": decode["tok_per_s"], "prefill_tok_per_s": {str(p["prompt_len"]): p["tok_per_s"] for p in prefill}}


def compare_latency(engine, settings, results: dict[str, Any], lc: LlamaCpp, rounds: int) -> dict[str, Any]:
    """Rounds of (kvserve, llama.cpp); round 1's kvserve figures are the ones `results`
    already holds (measured just before). Each engine's best round is compared."""
    import numpy as np

    from kvserve.bench.latency import decode_context_start, measure_decode, measure_prefill

    depth = supports_depth(lc)
    decode_args, prefill_args = llama_bench_args(lc, settings, depth)
    per_round = []
    for r in range(rounds):
        if r == 0:
            ours = _kvserve_figures(results["decode"], results["prefill"])
        else:
            _progress(f"kvserve: decode and prefill again (round {r + 1} of {rounds}) …")
            rng = np.random.default_rng(settings.seed + 1000 * r)
            ours = _kvserve_figures(measure_decode(engine, settings, rng),
                                    [measure_prefill(engine, n, settings.prefill_iters, rng) for n in settings.prompt_lens])
        _progress(f"llama.cpp: {LLAMA_BENCH} decode and prefill (round {r + 1} of {rounds}) …")
        theirs = run_llama_bench(lc, settings, depth)
        per_round.append({"kvserve": ours, "llama.cpp": theirs})
        if "error" in theirs:
            break

    ok = [x["llama.cpp"] for x in per_round if "error" not in x["llama.cpp"]]
    out: dict[str, Any] = {
        "bin_dir": str(lc.bin_dir),
        "model": str(lc.model),
        "threads": lc.threads,
        "commands": [lc.command(LLAMA_BENCH, decode_args), lc.command(LLAMA_BENCH, prefill_args)],
        "rounds": per_round,
        "kvserve_format": {"dtype": str(engine.config.torch_dtype).removeprefix("torch."),
                           "quantization": engine.config.quantization, "kv_cache_dtype": engine.config.kv_cache_dtype},
        "notes": [],
    }
    if not depth:
        out["notes"].append(f"this {LLAMA_BENCH} has no --n-depth: its decode starts from an empty context, kvserve's "
                            f"from {settings.decode_context_len + settings.decode_warmup_steps} positions")
    if not ok:
        out["error"] = per_round[-1]["llama.cpp"]["error"]
        return out
    first = ok[0]
    out["llama_cpp_model_type"] = first.get("model_type")
    out["llama_cpp_build"] = first.get("build_commit")
    rows = []
    kv_decode = max(x["kvserve"]["decode_tok_per_s"] for x in per_round)
    lc_decode = max(x["decode"]["tok_per_s"] for x in ok)
    rows.append({"phase": "decode", "tokens": f"ctx {decode_context_start(settings)}+{settings.decode_steps}",
                 "kvserve_tok_per_s": kv_decode, "llama_cpp_tok_per_s": lc_decode, "ratio": kv_decode / lc_decode,
                 "kvserve_rounds": [x["kvserve"]["decode_tok_per_s"] for x in per_round],
                 "llama_cpp_rounds": [x["decode"]["tok_per_s"] for x in ok]})
    for n in settings.prompt_lens:
        kv = [x["kvserve"]["prefill_tok_per_s"][str(n)] for x in per_round]
        theirs = [p["tok_per_s"] for x in ok for p in x["prefill"] if p["prompt_len"] == n]
        if not theirs:
            continue
        rows.append({"phase": "prefill", "tokens": str(n), "kvserve_tok_per_s": max(kv), "llama_cpp_tok_per_s": max(theirs),
                     "ratio": max(kv) / max(theirs), "kvserve_rounds": kv, "llama_cpp_rounds": theirs})
    out["rows"] = rows
    return out


def print_latency_comparison(comparison: dict[str, Any], console=None) -> None:
    from rich.table import Table

    console = console or _console()
    if "skipped" in comparison:
        console.print(f"llama.cpp comparison skipped: {comparison['skipped']}")
        return
    if "rows" not in comparison:
        console.print(f"llama.cpp could not run: {comparison.get('error')}")
        return
    f = comparison["kvserve_format"]
    console.print(f"llama.cpp {comparison.get('llama_cpp_build')} ({comparison.get('llama_cpp_model_type')}, the file's own "
                  f"tensor types) against kvserve ({f['dtype']}, quantization {f['quantization']}, kv {f['kv_cache_dtype']}), "
                  f"{comparison['threads']} threads each, {len(comparison['rounds'])} rounds in turn, best of each")
    table = Table(title="batch-1 latency against llama.cpp (llama-bench)")
    for col in ("phase", "tokens", "kvserve tok/s", "llama.cpp tok/s", "kvserve / llama.cpp", "kvserve rounds", "llama.cpp rounds"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for row in comparison["rows"]:
        table.add_row(row["phase"], row["tokens"], f"{row['kvserve_tok_per_s']:,.1f}", f"{row['llama_cpp_tok_per_s']:,.1f}",
                      f"{row['ratio']:.2f}", ", ".join(f"{x:,.0f}" for x in row["kvserve_rounds"]),
                      ", ".join(f"{x:,.0f}" for x in row["llama_cpp_rounds"]))
    console.print(table)
    for note in comparison.get("notes", []):
        console.print(f"note: {note}")
    if comparison.get("error"):
        console.print(f"llama.cpp: a later round failed: {comparison['error']}")


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=180)


# ---- throughput: llama-batched-bench ----------------------------------------------------


def batched_bench_args(lc: LlamaCpp, num_requests: int, input_len: int, output_len: int) -> list[str]:
    """All requests at once (`-npl N`), then one more, untimed by us, at batch 1: llama.cpp's
    logger writes from a thread that the process does not wait for at exit, so the last
    result line is sometimes lost; the batch-1 run gives the line that counts time to be written."""
    ctx = num_requests * (input_len + output_len)
    return ["-m", str(lc.model), "-t", str(lc.threads), "-c", str(ctx), "-npp", str(input_len), "-ntg", str(output_len),
            "-npl", f"{num_requests},1", "--output-format", "jsonl"]


def throughput_notes(range_ratio: float, shared_prefix_len: int) -> list[str]:
    notes = []
    if range_ratio:
        notes.append(f"{BATCHED_BENCH} runs fixed lengths (the mean input and output lengths); kvserve ran "
                     f"--range-ratio {range_ratio:g}")
    if shared_prefix_len:
        notes.append(f"{BATCHED_BENCH} runs no shared prefix; kvserve's prompts share {shared_prefix_len} tokens")
    return notes


def _batched_rows(proc: subprocess.CompletedProcess, num_requests: int, input_len: int, output_len: int) -> list[dict]:
    rows = []
    for line in ((proc.stdout or "") + "\n" + (proc.stderr or "")).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed"' in line:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("pl") == num_requests and row.get("pp") == input_len and row.get("tg") == output_len:
                rows.append(row)
    return rows


def run_batched_bench(lc: LlamaCpp, num_requests: int, input_len: int, output_len: int, notes: list[str]) -> dict[str, Any]:
    """One run of all requests at once; the figures in the shape of the throughput
    benchmark's engines (elapsed = prompt processing + generation)."""
    args = batched_bench_args(lc, num_requests, input_len, output_len)
    _progress(f"  {lc.command(BATCHED_BENCH, args)}")
    notes = [f"{BATCHED_BENCH}: {lc.threads} threads, the file's own tensor types", *notes]
    fmt = weight_format(lc.model)
    name = f"llama.cpp ({fmt})" if fmt else "llama.cpp"
    for _ in range(BATCHED_BENCH_ATTEMPTS):  # a lost result line (see batched_bench_args) is run again
        proc, peak = lc.run(BATCHED_BENCH, args)
        if proc.returncode:
            return {"engine": name, "error": f"{BATCHED_BENCH} {_error(proc)}", "command": lc.command(BATCHED_BENCH, args)}
        rows = _batched_rows(proc, num_requests, input_len, output_len)
        if rows:
            break
    else:
        return {"engine": name, "error": f"{BATCHED_BENCH} printed no result line in {BATCHED_BENCH_ATTEMPTS} runs",
                "command": lc.command(BATCHED_BENCH, args)}
    row = rows[0]
    elapsed_s = float(row["t"])
    prompt_tokens, output_tokens = row["pl"] * row["pp"], row["pl"] * row["tg"]
    result = {
        "engine": name,
        "elapsed_s": elapsed_s,
        "requests_per_s": row["pl"] / elapsed_s,
        "output_tok_per_s": output_tokens / elapsed_s,
        "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed_s,
        "generated_tokens": output_tokens,
        "peak_rss_mib": peak,
        "prefill_tok_per_s": row["speed_pp"],
        "decode_tok_per_s": row["speed_tg"],
        "n_threads": row.get("n_threads"),
        "n_batch": row.get("n_batch"),
        "n_ubatch": row.get("n_ubatch"),
        "command": lc.command(BATCHED_BENCH, args),
    }
    if notes:
        result["note"] = "; ".join(notes)
    return result
