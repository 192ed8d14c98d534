"""Plan sections about time and money: latency (§4), TP (§5), disaggregation (§7), cost (§8)."""

from __future__ import annotations

from kvserve.planner import capacity, cost, disagg, latency, parallel
from kvserve.planner.quantity import Quantity as Q
from kvserve.planner.quantity import Section
from kvserve.planner.quantity import num


def build(d) -> list:
    return [
        Section("latency", "Prefill, TTFT and total time (§4)", latency_section(d)),
        Section("tp", "Tensor parallelism and communication (§5)", tp_section(d)),
        Section("disagg", "Prefill/decode disaggregation (§7)", disagg_section(d)),
        Section("cost", "Cost (§8)", cost_section(d)),
    ]


def latency_section(d) -> list[Q]:
    i, m, chip = d.inputs, d.inputs.model, d.inputs.chip
    step, n_out = d.decode_step.total_s, i.output_tokens
    effect = latency.optimisation_effect(d.prefill_s, step, n_out)
    saved_prefill = effect.total_s - effect.halved_prefill_total_s
    saved_decode = effect.total_s - effect.halved_decode_total_s
    helps = "decode" if saved_decode > saved_prefill else "prefill"
    p = d.placement()
    P = "2·P_active" if d.experts else "2·P"
    kv_ceiling = p.num_chips * chip.hbm_bytes_per_s / d.kv_bytes_per_request if p.layout == "requests" else \
        chip.hbm_bytes_per_s / p.kv_bytes_per_request_per_chip
    return [
        Q("prefill_flops", "prefill projection work", latency.prefill_projection_flops(d.active_params, i.prompt_positions), "FLOP",
          P + "·S", f"2·{num(d.active_params)}·{i.prompt_positions}", note="forward only: not 6PS; attention pairs apart"
          + ("; P_active: each token's k experts" if d.experts else "")),
        Q("prefill_s", "prefill time", d.prefill_s, "s", P + "·S/(N·C·η)",
          f"2·{num(d.active_params)}·{i.prompt_positions}/({i.num_chips}·{num(chip.peak_flops_per_s)}·{num(i.utilisation)})"),
        Q("ttft_s", "TTFT (no queueing, no network)", effect.ttft_s, "s", "t_prefill", num(effect.ttft_s)),
        Q("total_s", "total time for N_out tokens", effect.total_s, "s", "t_prefill + (N_out − 1)·t_step",
          f"{num(d.prefill_s)} + {n_out - 1}·{num(step)}"),
        Q("halved_prefill_ttft_s", "TTFT with prefill halved", effect.halved_prefill_ttft_s, "s", "t_prefill/2", ""),
        Q("halved_prefill_total_s", "total with prefill halved", effect.halved_prefill_total_s, "s",
          "t_prefill/2 + (N_out − 1)·t_step", ""),
        Q("halved_decode_ttft_s", "TTFT with decode halved", effect.halved_decode_ttft_s, "s", "t_prefill", ""),
        Q("halved_decode_total_s", "total with decode halved", effect.halved_decode_total_s, "s",
          "t_prefill + (N_out − 1)·t_step/2", ""),
        Q("optimisation_for_total", "halving which shortens total time more", helps, "", "compare the two totals",
          f"prefill saves {num(saved_prefill)} s, decode saves {num(saved_decode)} s",
          note="TTFT improves only by optimising prefill"),
        Q("kv_read_throughput_ceiling", "throughput ceiling from KV reads alone", kv_ceiling, "tok/s", "β/K_chip per request",
          "", note="the read-only model's limit as B grows; capacity, compute and the target bind first"),
    ]


def tp_section(d) -> list[Q]:
    i, m, chip = d.inputs, d.inputs.model.arch, d.inputs.chip
    N, B, D, pa = i.num_chips, d.decode_batch, m.hidden_size, i.bytes_per_activation
    bw, alpha = chip.link_bytes_per_s, chip.link_latency_s
    ar = parallel.collective_time_s("allreduce", N, B, D, pa, bw, alpha)
    rs = parallel.collective_time_s("reducescatter", N, B, D, pa, bw, alpha)
    per_step = parallel.tp_comm_s_per_step(m.num_layers, N, B, D, pa, bw, alpha)
    out = [
        Q("partial_sum_bytes", "[B, D] partial sums per reduction", parallel.partial_sum_bytes(B, D, pa), "B", "B·D·p_a",
          f"{B}·{D}·{num(pa)}", note="does not shrink as chips are added"),
        Q("allreduce_s", "AllReduce of [B, D]", ar, "s", "α + 2(N−1)/N·B·D·p_a/bw",
          f"{num(alpha)} + {num(parallel.collective_factor('allreduce', N))}·{num(B * D * pa)}/{num(bw)}" if N > 1 else "one chip: 0"),
        Q("reducescatter_s", "ReduceScatter of [B, D]", rs, "s", "α + (N−1)/N·B·D·p_a/bw",
          f"{num(alpha)} + {num(parallel.collective_factor('reducescatter', N))}·{num(B * D * pa)}/{num(bw)}" if N > 1 else "one chip: 0"),
        Q("tp_comm_s_per_step", "TP reductions per step, unoverlapped", per_step, "s", "2·L·t_AllReduce",
          f"2·{m.num_layers}·{num(ar)}", note="left out of the staged step time, as the seed does; compare with it"),
    ]
    return out + _tp_vs_replicas(d)


def _replica_chips(d) -> int | None:
    """--replica-chips, else the fewest chips (dividing N, valid layout) whose HBM holds the weights."""
    from kvserve.errors import ConfigError
    from kvserve.planner.layout import check_heads_layout

    i = d.inputs
    if i.replica_chips:
        return i.replica_chips
    for m in range(1, i.num_chips):
        if i.num_chips % m:
            continue
        try:
            if i.kv_layout == "heads":
                check_heads_layout(m, i.model.arch.num_heads, i.model.arch.num_kv_heads)
        except ConfigError:
            continue
        if capacity.capacity_batch(i.chip.hbm_bytes, i.reserved_bytes_per_chip, d.placement(num_chips=m)) >= 1:
            return m
    return None


def _tp_vs_replicas(d) -> list[Q]:
    i, m = d.inputs, d.inputs.model.arch
    rep = _replica_chips(d)
    if rep is None:
        return [Q("tp_winner", "TP vs independent replicas (batch 1 each)", None, "", "n/m replicas: (n/m)/t_m vs TP: 1/t_n", "",
                  note="no smaller replica fits (or N = 1): nothing to compare")]

    def t(chips: int) -> float:
        comm = parallel.tp_comm_s_per_step(m.num_layers, chips, 1, m.hidden_size, i.bytes_per_activation,
                                           i.chip.link_bytes_per_s, i.chip.link_latency_s)
        return d.step(1, num_chips=chips).total_s + comm

    cmp = parallel.tp_vs_replicas(t(rep), t(i.num_chips), i.num_chips, rep)
    n_rep = i.num_chips // rep
    return [
        Q("replica_step_s", f"replica step t_m on {rep} chip(s), B=1", cmp.replica_step_s, "s", "t_step(1) + TP comm", ""),
        Q("tp_step_s", f"TP step t_n on {i.num_chips} chips, B=1", cmp.tp_step_s, "s", "t_step(1) + TP comm", ""),
        Q("replicas_tokens_per_s", f"{n_rep} replicas, throughput", cmp.replicas_tokens_per_s, "tok/s", "(n/m)/t_m",
          f"{n_rep}/{num(cmp.replica_step_s)}"),
        Q("tp_tokens_per_s", "one TP replica, throughput", cmp.tp_tokens_per_s, "tok/s", "1/t_n", f"1/{num(cmp.tp_step_s)}"),
        Q("tp_step_needed_s", "TP step needed to win on throughput", cmp.tp_step_needed_s, "s", "t_n < t_m·m/n",
          f"{num(cmp.replica_step_s)}·{rep}/{i.num_chips}"),
        Q("tp_winner", "higher throughput at batch 1", cmp.winner, "", "", "",
          note="TP still gives the lower per-request latency when t_n < t_m"),
    ]


def disagg_section(d) -> list[Q]:
    i = d.inputs
    t_p, step = d.prefill_s, d.decode_step
    n_decode = i.output_tokens - 1
    prefill_rate = disagg.prefill_rate_req_per_s(t_p, i.prefill_groups)
    decode_rate = disagg.decode_rate_req_per_s(step.batch, step.total_s, n_decode)
    handoff = disagg.handoff_bytes_per_request(i.prompt_positions, d.kv_bytes_per_position)
    network = disagg.network_rate_req_per_s(i.handoff_bytes_per_s, handoff)
    rates = disagg.StageRates(prefill_rate, decode_rate, network)
    target = i.target_rate_req_per_s or (decode_rate if decode_rate != float("inf") else prefill_rate)
    return [
        Q("prefill_rate_per_group_req_per_s", "prefill rate per group", 1 / t_p, "req/s", "1/t_prefill", f"1/{num(t_p)}",
          note="a prefill group = N chips at η, as above"),
        Q("prefill_rate_req_per_s", f"prefill rate, {i.prefill_groups} group(s)", prefill_rate, "req/s", "G_p/t_prefill",
          f"{i.prefill_groups}/{num(t_p)}"),
        Q("decode_rate_req_per_s", "decode rate, one group", decode_rate, "req/s", "B/(t_step·(N_out − 1))",
          f"{step.batch}/({num(step.total_s)}·{n_decode})"),
        Q("prefill_groups_to_feed_decode", "prefill groups to feed one decode group",
          disagg.prefill_groups_to_feed(decode_rate, t_p) if n_decode else 0, "", "⌈decode rate·t_prefill⌉",
          f"⌈{num(decode_rate)}·{num(t_p)}⌉"),
        Q("handoff_bytes_per_request", "KV handed off per request", handoff, "B", "S_prompt·c_kv",
          f"{i.prompt_positions}·{num(d.kv_bytes_per_position)}"),
        Q("network_rate_req_per_s", "handoff network rate", network, "req/s", "bandwidth/handoff bytes",
          f"{num(i.handoff_bytes_per_s)}/{num(handoff)}"),
        Q("system_rate_req_per_s", "system rate (min of stages)", rates.system_req_per_s, "req/s", "min(prefill, decode, network)",
          f"min({num(prefill_rate)}, {num(decode_rate)}, {num(network)})"),
        Q("bottleneck", "bottleneck stage", rates.bottleneck, "", "argmin", ""),
        Q("target_rate_req_per_s", "target rate", target, "req/s", "", "",
          note="--target-rate-req-per-s, else the decode group's rate"),
        Q("handoff_bytes_per_s_needed", "handoff bandwidth needed at target", disagg.bandwidth_for_rate(target, handoff), "B/s",
          "rate·S_prompt·c_kv", f"{num(target)}·{num(handoff)}", note="an average; says nothing of queues or tails"),
        Q("handoff_gap_s", "first-to-second token gap", latency.handoff_gap_s(handoff / i.handoff_bytes_per_s, step.total_s), "s",
          "handoff bytes/bandwidth + t_step", f"{num(handoff / i.handoff_bytes_per_s)} + {num(step.total_s)}"),
    ]


def cost_section(d) -> list[Q]:
    i, step = d.inputs, d.decode_step
    c = i.chip.cost_usd_per_chip_s
    full_rate = step.batch / step.total_s
    out = [Q("tokens_per_s_per_chip_full_load", "throughput per chip at full load", full_rate / i.num_chips, "tok/s",
             "B/(N·t)", f"{step.batch}/({i.num_chips}·{num(step.total_s)})")]
    if c is None:
        return out + [Q("cost_per_token_usd", "device cost per token", None, "USD", "c·N·t/B", "",
                        note="the chip has no price: pass --chip-cost-usd-per-hour")]
    per_token = cost.cost_per_token_usd(c, i.num_chips, step.total_s, step.batch)
    out += [
        Q("cost_usd_per_chip_s", "price per chip-second c", c, "USD", "", f"{num(c * 3600)} USD/h / 3600"),
        Q("cost_per_token_usd", "device cost per token, full load", per_token, "USD", "c·N·t/B",
          f"{num(c)}·{i.num_chips}·{num(step.total_s)}/{step.batch}", note="decode devices only"),
        Q("cost_per_million_tokens_usd", "per million tokens, full load", per_token * 1e6, "USD", "10⁶·c·N·t/B", ""),
    ]
    if i.arrival_rate_req_per_s:
        tokens = i.arrival_rate_req_per_s * i.output_tokens
        at_rate = cost.cost_per_token_at_rate_usd(c, i.num_chips, step.total_s, step.batch, tokens)
        out.append(Q("cost_per_million_tokens_at_arrival_usd", "per million tokens at the arrival rate", at_rate * 1e6, "USD",
                     "10⁶·c·N/min(λ·N_out, B/t)", f"10⁶·{num(c)}·{i.num_chips}/min({num(tokens)}, {num(full_rate)})",
                     note="chips are paid for while idle" if tokens < full_rate else "at or past full load: queues grow"))
    return out
