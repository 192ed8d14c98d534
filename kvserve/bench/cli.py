"""`kvserve bench latency | throughput | serve | quality | structured`: the flags.

Each command prints a table, and writes its figures with the machine they ran on to
`--json FILE`, and where a picture helps, a PNG to `--plot FILE`. The commands
themselves (validation at the edge, then the run) are in `commands.py`, imported only
when one runs.
"""

from __future__ import annotations

import argparse

from kvserve.engine_args import add_engine_args


def _command(name: str):
    def run(args: argparse.Namespace) -> int:
        from kvserve.bench import commands

        try:
            return getattr(commands, name)(args)
        finally:
            commands.close_engines()

    return run


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure the engine: latency, throughput, serving load, output quality",
                                  description="Benchmarks that print their figures (and write them as JSON).")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")

    lat = sub.add_parser("latency", help="batch-1 decode and prefill tokens/s against the measured roofline")
    lat.add_argument("--prompt-lens", default="128,512,2048", help="prefill prompt lengths, comma-separated (default 128,512,2048)")
    lat.add_argument("--prefill-iters", type=int, default=3, help="timed prefills per length, after one warm-up (default 3)")
    lat.add_argument("--decode-context-len", type=int, default=128, help="prompt length before decoding (default 128)")
    lat.add_argument("--decode-warmup-steps", type=int, default=8, help="untimed decode steps (default 8)")
    lat.add_argument("--decode-steps", type=int, default=64, help="timed decode steps (default 64)")
    lat.add_argument("--read-share-steps", type=int, default=32,
                     help="decode steps each timed between two reads of the bytes a step reads, for decode's share of "
                          "the read bandwidth as the host gives it at that moment (default 32; 0: skip)")
    lat.add_argument("--read-mib", type=float, default=None,
                     help="tensor summed to measure memory-read bandwidth, MiB (default: the bytes one decode step reads)")
    lat.add_argument("--gemm-size", type=int, default=2048, help="n of the n×n bf16 matmul measuring FLOP/s (default 2048)")
    lat.add_argument("--calibration-seconds", type=float, default=1.0, help="time per machine measurement (default 1)")
    lat.add_argument("--seed", type=int, default=0)
    _add_llama_cpp(lat, rounds=True)
    _add_outputs(lat, plot=True)
    add_engine_args(lat)
    lat.set_defaults(func=_command("latency"))

    thr = sub.add_parser("throughput", help="N requests at once: output and total tokens/s, peak RSS (optionally vs transformers)")
    _add_workload(thr, num_prompts=64)
    thr.add_argument("--compare", choices=["hf"], default=None, help="also run transformers on the same workload")
    thr.add_argument("--hf-modes", default="generate,generate_batch",
                     help="transformers modes for --compare hf: generate (static batches), generate_batch (continuous)")
    thr.add_argument("--rounds", type=int, default=1,
                     help="run the engines in turn this many times; each keeps its fastest round (default 1)")
    thr.add_argument("--hf-batch-size", type=int, default=None, help="static batch of transformers generate (default: all requests)")
    thr.add_argument("--shared-prefix-len", type=int, default=0,
                     help="tokens of a common prefix (e.g. a system prompt) before each prompt (default 0: none)")
    thr.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes, given out round robin (default 1)")
    thr.add_argument("--profile-attention", action="store_true",
                     help="run kvserve under torch.profiler and report its decode attention time per step (CPU kernels only)")
    thr.add_argument("--shared-prefix-attention-ab", action="store_true",
                     help="with the profiler, alternate steps with and without shared-prefix attention in one run and "
                     "report the decode attention time per step of each (a comparison that holds on a noisy machine)")
    _add_llama_cpp(thr)
    _add_outputs(thr, plot=True)
    add_engine_args(thr)
    thr.set_defaults(func=_command("throughput"))

    _register_quality(sub)

    srv = sub.add_parser("serve", help="load an OpenAI-compatible server at a sweep of request rates")
    srv.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    srv.add_argument("--model-name", default=None, help="model field of the requests (default: the first of /v1/models)")
    srv.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, if set)")
    _add_workload(srv, num_prompts=64)
    srv.add_argument("--request-rate", default="inf", help="requests/s, comma-separated for a sweep; inf sends all at once (default inf)")
    srv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier (default 1)")
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    srv.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                     help="ids: random token ids, exact lengths; text: random words, about one token each (default ids)")
    srv.add_argument("--vocab-size", type=int, default=32000, help="random ids are drawn below this (default 32000)")
    srv.add_argument("--warmup-requests", type=int, default=2, help="sequential requests before timing (default 2)")
    srv.add_argument("--request-timeout-s", type=float, default=600.0, help="give up on one request after this (default 600)")
    srv.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO: time to first token")
    srv.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO: time per output token")
    srv.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO: end-to-end latency")
    srv.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_outputs(srv, plot=True)
    srv.set_defaults(func=_command("serve"))

    from kvserve.bench.structured import register as _register_structured  # its flags beside its body

    _register_structured(sub)

    from kvserve.bench.sim_vs_real import register as _register_sim_vs_real

    _register_sim_vs_real(sub)


def _add_workload(p: argparse.ArgumentParser, num_prompts: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests (default {num_prompts})")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens per request, EOS ignored (default 128)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len·[1−r, 1+r]; 0 = fixed (default 0)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and lengths (default 0)")


def _add_outputs(p: argparse.ArgumentParser, plot: bool) -> None:
    p.add_argument("--json", metavar="FILE", default=None, help="write the figures, machine and command as JSON")
    if plot:
        p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG plot")


def _int_in(low: int, high: int | None = None):
    """An argparse type: a bad value is a usage error (exit status 2) naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}" if high is not None
                                             else f"must be >= {low}, got {value}")
        return value

    return parse


_positive_int = _int_in(1)


def _register_quality(sub) -> None:
    q = sub.add_parser("quality", help="perplexity, KL divergence and greedy agreement of a format against a reference",
                       description="Measure a weight / KV-cache format (the engine flags: --quantization, --kv-cache-dtype, "
                                   "--dtype) against a reference configuration of the same model file: perplexity on a "
                                   "shipped text, mean KL(ref || cand) of the next-token distribution, greedy agreement "
                                   "on 20 fixed prompts.")
    q.add_argument("--ppl-window", type=_positive_int, default=512,
                   help="positions per perplexity window; stride = window, context reset at each (default 512)")
    q.add_argument("--ppl-tokens", type=_positive_int, default=2048, help="predicted positions in all (default 2048)")
    q.add_argument("--greedy-tokens", type=_positive_int, default=64, help="greedy tokens per prompt (default 64)")
    q.add_argument("--greedy-prompts", type=_int_in(1, 20), default=20, metavar="N",
                   help="how many of the 20 shipped prompts, 1 to 20 (default 20)")
    q.add_argument("--text", metavar="FILE", default=None,
                   help="the perplexity text (default: the one shipped, kvserve/bench/data/quality.txt)")
    q.add_argument("--ref-dtype", default="float32", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the reference's --dtype (default float32)")
    q.add_argument("--ref-quantization", default="none", choices=["auto", "none", "int8", "int4"],
                   help="the reference's --quantization (default none: the file's weights dequantized)")
    q.add_argument("--ref-kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"],
                   help="the reference's --kv-cache-dtype (default auto: the reference's dtype)")
    _add_outputs(q, plot=False)
    add_engine_args(q)
    q.set_defaults(func=_command("quality"))


def _add_llama_cpp(p: argparse.ArgumentParser, rounds: bool = False) -> None:
    tool = "llama-bench" if rounds else "llama-batched-bench"
    p.add_argument("--compare-llama-cpp", metavar="DIR", default=None,
                   help=f"also run llama.cpp's {tool} from DIR (with LD_LIBRARY_PATH=DIR) on the same .gguf, in turn with "
                        "kvserve, same thread count; skipped, with the reason, when DIR lacks it or the model is not a GGUF"
                        + ("" if rounds else " (one llama.cpp run per --rounds round)"))
    if rounds:
        p.add_argument("--llama-cpp-rounds", type=_positive_int, default=2,
                       help="with --compare-llama-cpp: rounds of (kvserve, llama.cpp) in turn; each engine's best round "
                            "is compared (default 2)")
