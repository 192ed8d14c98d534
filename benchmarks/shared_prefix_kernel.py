"""Timing of the read-once shared-prefix decode attention kernels against the plain decode kernel.

    python -m benchmarks.shared_prefix_kernel [--layers 30] [--repeats 20] [--private 80]

Not a test: for each workload, one decode step's attention of every layer (each layer its own
pools, as in the model, so the shared prefix is not warm in the cache from the previous layer's
call), timed as
  plain    paged_decode_attention over each request's whole history;
  shared   shared_prefix_decode_attention, the call the fused decode step makes per layer: each
           row's suffix, then shared_prefix_attention per group, merged in place;
and printed as ms per layer-call (the fastest of --repeats sweeps) and their ratio. Default model shapes (SmolLM2: 9 query heads,
3 KV heads, head_dim 64), bf16 pools, 16-position blocks.

Both do the same multiply-adds (each query against each of its positions, QK and PV), so
each is also given as GMAC/s beside a roofline measured in the same run: a bf16 GEMM of
torch's (oneDNN) on 2048 x 2048 matrices, about the best these cores do on bf16 products.
Reading a prefix once saves memory traffic, not arithmetic: where the plain kernel already
runs near that rate, reading once cannot be much faster.

"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels import cpu_ops, unavailable_reason

BLOCK = 16


def _workload(groups, per_group, prefix_len, private, num_heads, num_kv_heads, head_dim, layers, seed=0):
    prefix_blocks_n = prefix_len // BLOCK
    private_blocks = -(-private // BLOCK)
    num_blocks = groups * prefix_blocks_n + groups * per_group * private_blocks
    g = torch.Generator().manual_seed(seed)
    pools = [
        (torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).bfloat16(),
         torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).bfloat16())
        for _ in range(layers)
    ]  # fmt: skip
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    prefixes = [order[i * prefix_blocks_n : (i + 1) * prefix_blocks_n] for i in range(groups)]
    used, rows = groups * prefix_blocks_n, []
    for grp in range(groups):
        for _ in range(per_group):
            rows.append(torch.cat([prefixes[grp], order[used : used + private_blocks]]))
            used += private_blocks
    tables = torch.stack(rows)
    n = groups * per_group
    lens = torch.full((n,), prefix_len + private, dtype=torch.int32)
    starts = torch.full((n,), prefix_len, dtype=torch.int32)
    q = torch.randn(n, num_heads, head_dim, generator=g).bfloat16()
    return pools, prefixes, tables, lens, starts, q


def _time(fn, layers, repeats):
    fn(0)  # warm-up
    for layer in range(1, layers):
        fn(layer)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        samples.append((time.perf_counter() - t0) / layers * 1e3)
    return min(samples)  # the least disturbed sweep: on a shared machine the median drifts with its load


def run_case(ops, groups, per_group, prefix_len, private, layers, repeats, shape=(9, 3, 64)):
    num_heads, num_kv_heads, head_dim = shape
    pools, prefixes, tables, lens, starts, q = _workload(
        groups, per_group, prefix_len, private, num_heads, num_kv_heads, head_dim, layers
    )
    scale = head_dim**-0.5
    group_q = [q[i * per_group : (i + 1) * per_group] for i in range(groups)]

    def plain(layer):
        k, v = pools[layer]
        return ops.paged_decode_attention(q, k, v, tables, lens, scale)

    plan = ops.SharedPrefixDecodePlan(
        suffix_start=starts,
        levels=[
            ops.SharedPrefixLevel(members=torch.arange(i * per_group, (i + 1) * per_group), blocks=pb, num_positions=prefix_len)
            for i, pb in enumerate(prefixes)
        ],
    )

    def shared(layer):
        k, v = pools[layer]
        return ops.shared_prefix_decode_attention(q, k, v, tables, lens, plan, scale)

    err = (plain(0).float() - shared(0).float()).abs().max().item()
    t_plain = _time(plain, layers, repeats)
    t_shared = _time(shared, layers, repeats)
    # the shared-prefix call's parts on their own (layer 0..L-1 as above)
    t_prefix = _time(lambda l: [ops.shared_prefix_attention(gq, pools[l][0], pools[l][1], pb, prefix_len, scale)
                                for gq, pb in zip(group_q, prefixes)], layers, repeats)  # fmt: skip
    t_suffix = _time(lambda l: ops.paged_decode_attention_lse(q, pools[l][0], pools[l][1], tables, lens, starts, scale),
                     layers, repeats)  # fmt: skip
    macs = 2 * groups * per_group * (prefix_len + private) * num_heads * head_dim  # QK and PV
    rate = lambda ms: macs / (ms * 1e-3) / 1e9  # noqa: E731
    name = f"{groups} x {per_group} requests, {prefix_len}-position prefix, {private} private each"
    print(f"{name}:")
    print(f"  plain paged_decode_attention   {t_plain:7.3f} ms per layer-call   {rate(t_plain):6.1f} GMAC/s")
    print(f"  shared  (prefix+suffix+merge)  {t_shared:7.3f} ms per layer-call   {rate(t_shared):6.1f} GMAC/s"
          f"   (prefix {t_prefix:.3f}, suffix {t_suffix:.3f})")  # fmt: skip
    print(f"  speed-up {t_plain / t_shared:5.2f}x   max |plain - shared| {err:.2e}")
    return t_plain, t_shared


def gemm_roofline_gmacs(repeats: int, n: int = 2048) -> float:
    """bf16 multiply-adds per second of torch's GEMM on n x n matrices (fastest of `repeats`)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).bfloat16()
    b = torch.randn(n, n, generator=g).bfloat16()
    torch.matmul(a, b)
    best = min(_once(lambda: torch.matmul(a, b)) for _ in range(max(3, repeats // 4)))
    return n**3 / best / 1e9


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="layers, each with its own pools (default 30, SmolLM2's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--private", type=int, default=80, help="private positions per request (64 prompt + some output)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    ops = cpu_ops()
    if ops is None:
        raise SystemExit(f"CPU kernels unavailable: {unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, AMX {'on' if ops.amx_available() else 'off'}, {args.layers} layers")
    print(f"roofline: torch bf16 GEMM 2048^3 {gemm_roofline_gmacs(args.repeats):.1f} GMAC/s")
    run_case(ops, 1, 16, 2048, args.private, args.layers, args.repeats)
    run_case(ops, 4, 16, 1024, args.private, args.layers, args.repeats)
    print(f"roofline again: {gemm_roofline_gmacs(args.repeats):.1f} GMAC/s")


if __name__ == "__main__":
    main()
