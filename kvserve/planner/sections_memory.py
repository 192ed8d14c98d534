"""Plan sections about bytes and work: KV cache (§3), attention (§2, §4), batch and layout (§5, §6, §8)."""

from __future__ import annotations

from kvserve.planner import attention, capacity, kv
from kvserve.planner.capacity import ideal_kv_capacity_bytes
from kvserve.planner.layout import KV_LAYOUTS, kv_heads_per_chip
from kvserve.planner.quantity import Quantity as Q
from kvserve.planner.quantity import Section
from kvserve.planner.quantity import num
from kvserve.planner.roofline import critical_batch


def build(d) -> list:
    return [
        Section("kv", "KV cache (§3)", kv_section(d)),
        Section("attention", "Attention work (§2, §4)", attention_section(d)),
        Section("batch", "Layout, capacity and batch (§5, §6, §8)", batch_section(d)),
    ]


def kv_section(d) -> list[Q]:
    i, m = d.inputs, d.inputs.model.arch
    c_kv, S, B = d.kv_bytes_per_position, i.history_positions, d.decode_batch
    rho = d.placement().kv_replication_factor
    b = i.kv_block_positions
    shared, private = i.shared_prefix_positions, S - i.shared_prefix_positions
    g = m.queries_per_kv_head
    s = i.kv_scale_bytes
    if s:  # a quantized cache: a scale per (position, KV head) beside the H elements
        c_kv_q = Q("kv_bytes_per_position", "KV bytes per position c_kv", c_kv, "B", "c_kv = 2·L·N_kv·(H·p_kv + s)",
                   f"2·{m.num_layers}·{m.num_kv_heads}·({m.head_dim}·{num(i.bytes_per_kv_element)} + {num(s)}) = {num(c_kv)}",
                   note=f"s = {num(s)} B of scale per position and KV head")
    else:
        c_kv_q = Q("kv_bytes_per_position", "KV bytes per position c_kv", c_kv, "B", "c_kv = 2·L·N_kv·H·p_kv",
                   f"2·{m.num_layers}·{m.num_kv_heads}·{m.head_dim}·{num(i.bytes_per_kv_element)} = {num(c_kv)}")
    p_kv_eff = i.bytes_per_kv_element + s / m.head_dim  # bytes read per K/V element, scales included
    windows = m.layer_windows
    if any(w is not None for w in windows):  # sliding-window layers keep their last W positions only
        kinds = sorted({w for w in windows if w is not None})
        per_kind = " + ".join(f"{sum(x == w for x in windows)}·min(S, {w})" for w in kinds)
        n_global = sum(w is None for w in windows)
        kv_q = [
            Q("kv_bytes_per_request", "logical KV per request at S, windows held", d.kv_bytes_per_request, "B",
              "Σ_l min(S, W_l)·c_kv/L", f"({n_global}·{S} + {per_kind})·{num(c_kv)}/{m.num_layers} = {num(d.kv_bytes_per_request)}",
              note=f"{n_global} global layers keep all S positions, the others their window's; "
                   f"{num(d.held_positions)} positions per layer on average"),
            Q("kv_bytes_per_request_every_position", "logical KV per request at S, every position kept", S * c_kv, "B",
              "S·c_kv", f"{S}·{num(c_kv)} = {num(S * c_kv)}", note="an engine that keeps the windowed layers' old positions"),
        ]
    else:
        kv_q = [Q("kv_bytes_per_request", "logical KV per request at S", d.kv_bytes_per_request, "B", "S·c_kv",
                  f"{S}·{num(c_kv)} = {num(d.kv_bytes_per_request)}")]
    return [
        c_kv_q,
        *kv_q,
        Q("queries_per_kv_head", "Query heads per KV head g", g, "", "g = N_q/N_kv", f"{m.num_heads}/{m.num_kv_heads} = {g}"),
        Q("gqa_intensity_flops_per_byte", "attention intensity (GQA)", kv.gqa_intensity_flops_per_byte(g, p_kv_eff),
          "FLOP/B", "4·g·S·H / (2·S·H·p_kv) = 2g/p_kv" if not s else "4·g·S·H / (2·S·(H·p_kv + s)) = 2g/(p_kv + s/H)",
          f"2·{g}/{num(p_kv_eff)}",
          note="independent of S: doubling history doubles both FLOPs and KV reads"),
        Q("logical_kv_bytes_batch", "logical KV of the decode batch", kv.logical_kv_bytes(S, c_kv, B), "B", "B·S·c_kv",
          f"{B}·{S}·{num(c_kv)}"),
        Q("physical_kv_bytes_batch", "physical KV of the decode batch", kv.physical_kv_bytes(B, S, c_kv, b, rho), "B",
          "B·⌈S/b⌉·b·c_kv·ρ", f"{B}·{kv.paged_positions(S, b)}·{num(c_kv)}·{num(rho)}",
          note="page rounding b and layout replication ρ; quantisation metadata and fragmentation not counted"),
        Q("shared_prefix_stored_bytes", "stored KV, shared prefix once", kv.shared_prefix_stored_bytes(B, shared, private, c_kv), "B",
          "(S_shared + B·S_private)·c_kv", f"({shared} + {B}·{private})·{num(c_kv)}",
          note="set --shared-prefix-positions; requests share that exact prefix"),
        Q("shared_prefix_read_bytes", "KV read per step, per-request scan", kv.shared_prefix_read_bytes(B, shared, private, c_kv), "B",
          "B·(S_shared + S_private)·c_kv", f"{B}·({shared} + {private})·{num(c_kv)}",
          note="a kernel without cross-request reuse rereads the shared prefix once per request"),
        Q("shared_prefix_read_once_bytes", "KV read per step, shared prefix read once",
          kv.shared_prefix_read_once_bytes(B, shared, private, c_kv), "B", "(S_shared + B·S_private)·c_kv",
          f"({shared} + {B}·{private})·{num(c_kv)}",
          note="shared-prefix attention: one load of each shared block serves every request's queries; "
               + ("the decode step below uses it" if i.reads_shared_prefix_once
                  else "--shared-prefix-reads per-request: the step below uses the per-request scan" if shared
                  else "set --shared-prefix-positions")),
    ]


def attention_section(d) -> list[Q]:
    i, m = d.inputs, d.inputs.model.arch
    S0, T, H, Sp = i.history_positions, i.attention_new_positions, m.head_dim, i.prompt_positions
    heads = f"{m.num_layers}·{m.num_heads}"
    hist = m.num_layers * m.num_heads * attention.attention_history_flops(S0, T, H)
    tri = m.num_layers * m.num_heads * attention.attention_triangle_flops(T, H)
    half = Sp // 2
    return [
        Q("attention_history_flops", "history term, T new after S0 cached", hist, "FLOP", "L·N_q·4H·T·S0",
          f"{heads}·4·{H}·{T}·{S0}", note="S0 = --history-positions, T = --new-positions (default N_out − 1)"),
        Q("attention_triangle_flops", "triangle among the T new positions", tri, "FLOP", "L·N_q·4H·T(T+1)/2",
          f"{heads}·4·{H}·{T}·{T + 1}/2"),
        Q("attention_flops", "attention total", hist + tri, "FLOP", "L·N_q·4H·(T·S0 + T(T+1)/2)", f"{num(hist)} + {num(tri)}"),
        Q("prefill_causal_pairs", "causal pairs per head, one prompt", attention.causal_pairs(Sp), "", "S(S+1)/2",
          f"{Sp}·{Sp + 1}/2"),
        Q("prefill_split_pairs", "pairs per head, two independent halves", attention.independent_sequences_pairs(Sp, 2), "",
          "2·(S/2)(S/2+1)/2", f"2·{half}·{half + 1}/2",
          note="projection work 2·P·S is the same for both; attention work is not"),
    ]


def batch_section(d) -> list[Q]:
    i, m, chip = d.inputs, d.inputs.model, d.inputs.chip
    p = d.placement()
    N, R, H_mem, beta, C = i.num_chips, i.reserved_bytes_per_chip, chip.hbm_bytes, chip.hbm_bytes_per_s, chip.peak_flops_per_s
    cap = d.capacity_batch()
    free = capacity.free_bytes_per_chip(H_mem, R, p)
    ideal = ideal_kv_capacity_bytes(N, H_mem, R, d.weight_bytes)
    b_star = critical_batch(C, beta, i.bytes_per_weight)
    held = p.weight_bytes_held_per_chip is not None
    w_chip = "W_chip" if held else "W/N"  # what capacity subtracts: the exact share where known
    out = [
        Q("weight_bytes_per_chip", "weights per chip W/N", p.weight_bytes_per_chip, "B", "P·p_w/N",
          f"{num(m.num_params)}·{num(i.bytes_per_weight)}/{N}"),
        _sharded_weights(d),
    ]
    if i.kv_layout == "heads":
        per_chip = kv_heads_per_chip(N, m.arch.num_kv_heads)
        out.append(Q("kv_heads_per_chip", "KV heads per chip", per_chip, "", "max(N_kv/N, 1)", f"max({m.arch.num_kv_heads}/{N}, 1)"))
        share = f"{num(d.kv_bytes_per_request)}·{per_chip}/{m.arch.num_kv_heads}"
        per_request_formula = "S·c_kv·N_kv,chip/N_kv"
    else:
        share, per_request_formula = f"{num(d.kv_bytes_per_request)}/{N}", "S·c_kv/N (average; whole requests per chip)"
    out += [
        Q("kv_replication_factor", "KV replication factor ρ", p.kv_replication_factor, "",
          "N·N_kv,chip/N_kv (heads), 1 (requests)", f"layout {i.kv_layout}"),
        Q("kv_bytes_per_request_per_chip", "local KV per request per chip", p.kv_bytes_per_request_per_chip, "B", per_request_formula, share),
        Q("free_bytes_per_chip", "room for KV per chip", free, "B", f"H_mem − R − {w_chip}",
          f"{num(H_mem)} − {num(R)} − {num(p.weight_bytes_in_memory)}",
          note="W_chip: the busiest chip's exact weight share" if held else ""),
        Q("capacity_batch", "capacity-limited batch", cap, "requests", f"⌊(H_mem − R − {w_chip}) / K_chip⌋ (× N for requests)",
          f"⌊{num(free)}/{num(p.kv_bytes_per_request_allocated * p.kv_fraction_per_chip)}⌋"
          + ("" if i.kv_layout == "heads" else f"·{N}"), note="busiest chip, KV rounded to whole pages"),
        Q("ideal_kv_capacity_bytes", "ideal KV room, no replication (§8)", ideal, "B", "N·H_mem − N·R − W",
          f"{N}·{num(H_mem)} − {N}·{num(R)} − {num(d.weight_bytes)}"),
        Q("ideal_capacity_batch", "ideal batch, no replication (§8)", max(int(ideal // d.kv_bytes_per_request_allocated), 0),
          "requests", "⌊(N·H_mem − N·R − W)/(S·c_kv)⌋", f"⌊{num(ideal)}/{num(d.kv_bytes_per_request_allocated)}⌋"),
        Q("critical_batch", "critical batch B* (projections compute-bound)", b_star, "", "B* = C·p_w/(2β)",
          f"{num(C)}·{num(i.bytes_per_weight)}/(2·{num(beta)})"),
        Q("critical_batch_half_weight_bytes", "B* with p_w halved, same C", b_star / 2, "", "C·(p_w/2)/(2β)",
          f"{num(b_star)}/2", note="doubling C as well would keep B* unchanged"),
    ]
    out += _experts(d)
    out += _step_quantities(d, cap)
    out += _layout_comparison(d)
    return out


def _experts(d) -> list[Q]:
    """A mixture of experts (planner/moe.py): the critical batch and the step's weight read move."""
    e = d.experts
    if e is None:
        return []
    i, chip = d.inputs, d.inputs.chip
    C, beta, pw = chip.peak_flops_per_s, chip.hbm_bytes_per_s, i.bytes_per_weight
    B = d.decode_batch
    b_star = e.critical_batch(C, beta, pw)
    touched = e.experts_touched(B)
    return [
        Q("moe_active_params", "active parameters per token P_active", e.active_params, "", "P − P_routed + L_sparse·k·P_expert",
          f"{num(e.num_params)} − {num(e.routed_params)} + {e.num_sparse_layers}·{e.top_k}·{num(e.expert_params)}"),
        Q("moe_experts_touched", "experts read per sparse layer at the decode batch", touched, "",
          "E·(1 − (1 − k/E)^B)", f"{e.num_experts}·(1 − (1 − {e.top_k}/{e.num_experts})^{B})",
          note=f"uniform routing; at most min(E, k·B) = {num(e.experts_touched(B, bound=True))}"),
        Q("moe_weight_bytes_read_per_step", "weight bytes one decode step reads", e.params_read(B) * pw, "B",
          "(P − P_routed + L_sparse·E_touched(B)·P_expert)·p_w", f"{num(e.params_read(B))}·{num(pw)}",
          note=f"a dense model of the same P reads {num(e.num_params * pw)} B; bound {num(e.params_read(B, bound=True) * pw)} B"),
        Q("moe_batch1_weight_bytes_read", "weight bytes a batch-1 step reads", e.params_read(1) * pw, "B",
          "(P − P_routed + L_sparse·k·P_expert)·p_w", f"{num(e.params_read(1))}·{num(pw)}"),
        Q("moe_critical_batch", "critical batch with routed experts", b_star, "",
          "B where 2·P_active·B/C = P_read(B)·p_w/β", f"dense B* would be {num(critical_batch(C, beta, pw))}",
          note="the read grows with B until every expert is touched, so B* moves up"),
    ]


def _sharded_weights(d) -> Q:
    """The busiest chip's exact weight bytes as the engine splits the model (weight_shares.py):
    what each rank's start-up report prints, and what capacity uses where it is known."""
    i, m = d.inputs, d.inputs.model.arch
    share = d.weight_share()
    label = "weights on the busiest chip, as the engine splits them"
    formula = "Σ rank 0's shards: Q/K/V/O by head (K/V whole past N_kv), gate/up/down F/N, ⌈V/N⌉ vocab rows, norms whole"
    if isinstance(share, str):
        return Q("weight_bytes_per_chip_sharded", label, None, "B", formula, "",
                 note=f"n/a: {share}; capacity uses W/N")
    parts = share.parts
    terms = f"{m.num_layers}·{num(share.per_layer_bytes)} + {num(parts['embedding'])}"
    if not m.tie_word_embeddings:
        terms += f" + {num(parts['lm_head'])}"
    terms += f" + {num(parts['final_norm'])}"
    diff = share.weight_bytes - d.placement().weight_bytes_per_chip
    extra = []
    if share.kv_replication > 1:
        extra.append(f"K/V projections on {share.kv_replication} chips each")
    if i.num_chips > 1:
        extra.append("norms on every chip")
        if m.vocab_size % i.num_chips:
            extra.append(f"⌈{m.vocab_size}/{i.num_chips}⌉ vocabulary rows")
    note = (f"{'+' if diff >= 0 else '−'}{num(abs(diff))} B on W/N{': ' + ', '.join(extra) if extra else ''}; "
            "capacity uses it, the step time W/N")
    return Q("weight_bytes_per_chip_sharded", label, share.weight_bytes, "B", formula,
             f"{terms} = {num(share.weight_bytes)} ({share.storage.describe()}, {num(share.params)} parameters)", note=note)


def _step_quantities(d, cap: int) -> list[Q]:
    i = d.inputs
    target = i.step_target_s
    b_max = d.max_batch_meeting_target()
    out = []
    if cap:
        at_cap = d.step(cap)
        out.append(Q("step_s_at_capacity", "step time at capacity batch", at_cap.total_s, "s",
                     "max(2·(P/N)·B/C, (W/N)/β) + K_chip(B)/β + t_x", _step_subst(at_cap), note=f"{at_cap.branch} branch"))
    if cap == 0:
        boundary = "the weights alone do not fit"
    elif b_max == cap:
        boundary = f"capacity {cap} binds first: t({cap}) = {num(d.step(cap).total_s)} s ≤ {num(target)} s"
    elif b_max == 0:
        boundary = f"even t(1) = {num(d.step(1).total_s)} s > {num(target)} s"
    else:
        boundary = f"t({b_max}) ≤ {num(target)} s < t({b_max + 1}) = {num(d.step(b_max + 1).total_s)} s"
    out.append(Q("max_batch_meeting_target", "largest batch meeting the step target", b_max, "requests",
                 "max B ≤ B_cap with t_step(B) ≤ t_target", boundary))
    step = d.decode_step
    out += [
        Q("decode_batch", "decode batch used below", d.decode_batch, "requests", "", "", note=d.decode_batch_note),
        Q("projection_compute_s", "projection compute 2·(P/N)·B/C", step.projection_compute_s, "s", "2·(P/N)·B/C",
          f"2·{num(d.placement().params_per_chip)}·{step.batch}/{num(i.chip.peak_flops_per_s)}"),
        Q("weight_read_s", "weight read (W/N)/β", step.weight_read_s, "s", "(W/N)/β",
          f"{num(d.placement().weight_bytes_per_chip)}/{num(i.chip.hbm_bytes_per_s)}"),
        Q("kv_read_s", "KV read K_chip(B)/β", step.kv_read_s, "s", "K_chip(B)/β",
          f"{num(d.placement().kv_read_bytes_on_busiest_chip(step.batch))}/{num(i.chip.hbm_bytes_per_s)}",
          note=_kv_read_note(i)),
        Q("exchange_s", "exchange time t_x", step.exchange_s, "s", "given (requests layout)", ""),
        Q("step_s", "decode step time", step.total_s, "s", "max(compute, weight read) + KV read + t_x", _step_subst(step)),
        *_shared_prefix_steps(d, step.batch),
        Q("projection_branch", "projection branch at the decode batch", step.branch, "", "compute if B > B*", ""),
        Q("meets_step_target", "meets the step target", step.total_s <= target, "", "t_step ≤ t_target",
          f"{num(step.total_s)} ≤ {num(target)}"),
        Q("fits_memory", "decode batch fits per-chip memory",
          capacity.fits(i.chip.hbm_bytes, i.reserved_bytes_per_chip, d.placement(), step.batch), "",
          f"{'W_chip' if d.placement().weight_bytes_held_per_chip is not None else 'W/N'} + K_chip(B) ≤ H_mem − R",
          f"{num(d.placement().weight_bytes_in_memory + d.placement().kv_allocated_bytes_on_busiest_chip(step.batch))} ≤ "
          f"{num(i.chip.hbm_bytes - i.reserved_bytes_per_chip)}"),
        Q("tokens_per_s", "system throughput", capacity.tokens_per_s(step.batch, step.total_s), "tok/s", "B/t_step",
          f"{step.batch}/{num(step.total_s)}"),
        Q("tokens_per_s_per_chip", "throughput per chip", capacity.tokens_per_s_per_chip(step.batch, step.total_s, i.num_chips),
          "tok/s", "B/(N·t_step)", f"{step.batch}/({i.num_chips}·{num(step.total_s)})"),
    ]
    return out


def _kv_read_note(i) -> str:
    if not i.shared_prefix_positions:
        return ""
    if i.reads_shared_prefix_once:
        return "K_chip = (S_shared + B·S_private)·c_kv·f: the shared prefix read once per step"
    return "K_chip = B·S·c_kv·f: every request scans its whole history (--shared-prefix-reads per-request)"


def _shared_prefix_steps(d, batch: int) -> list[Q]:
    """With a shared prefix, the decode batch's KV read and step time both ways."""
    i = d.inputs
    if not i.shared_prefix_positions:
        return []
    beta = i.chip.hbm_bytes_per_s
    once, scan = d.step(batch, read_once=True), d.step(batch, read_once=False)
    once_bytes = d.placement(read_once=True).kv_read_bytes_on_busiest_chip(batch)
    scan_bytes = d.placement(read_once=False).kv_read_bytes_on_busiest_chip(batch)
    return [
        Q("kv_read_bytes_read_once", "KV read per step on the busiest chip, prefix read once", once_bytes, "B",
          "(S_shared + B·S_private)·c_kv·f", ""),
        Q("kv_read_bytes_per_request_scan", "KV read per step on the busiest chip, per-request scan", scan_bytes, "B",
          "B·S·c_kv·f", ""),
        Q("kv_read_s_read_once", "KV read time, prefix read once", once.kv_read_s, "s", "K_chip(B)/β",
          f"{num(once_bytes)}/{num(beta)}"),
        Q("kv_read_s_per_request_scan", "KV read time, per-request scan", scan.kv_read_s, "s", "K_chip(B)/β",
          f"{num(scan_bytes)}/{num(beta)}"),
        Q("step_s_read_once", "decode step time, prefix read once", once.total_s, "s",
          "max(compute, weight read) + KV read + t_x", _step_subst(once)),
        Q("step_s_per_request_scan", "decode step time, per-request scan", scan.total_s, "s",
          "max(compute, weight read) + KV read + t_x", _step_subst(scan)),
    ]


def _step_subst(step) -> str:
    return (f"max({num(step.projection_compute_s)}, {num(step.weight_read_s)}) + {num(step.kv_read_s)} + "
            f"{num(step.exchange_s)} = {num(step.total_s)} s")


def _layout_comparison(d) -> list[Q]:
    """Both layouts side by side: where KV replication costs batch, and what exchange buys."""
    from kvserve.errors import ConfigError
    from kvserve.planner.layout import check_heads_layout

    i, m = d.inputs, d.inputs.model.arch
    out = []
    for layout in KV_LAYOUTS:
        if layout == "heads":
            try:
                check_heads_layout(i.num_chips, m.num_heads, m.num_kv_heads)
            except ConfigError as exc:
                out.append(Q("heads_layout_max_batch", "heads layout: largest batch meeting target", None, "", "", "", note=str(exc)))
                continue
        cap = d.capacity_batch(layout)
        b = d.max_batch_meeting_target(layout)
        step = d.step(b or 1, layout)
        placement = d.placement(layout)
        out += [
            Q(f"{layout}_layout_kv_bytes_per_request_per_chip", f"{layout} layout: local KV per request per chip",
              placement.kv_bytes_per_request_per_chip, "B", "", ""),
            Q(f"{layout}_layout_kv_replication_factor", f"{layout} layout: KV replication factor",
              placement.kv_replication_factor, "", "", ""),
            Q(f"{layout}_layout_capacity_batch", f"{layout} layout: capacity batch", cap, "requests", "", ""),
            Q(f"{layout}_layout_max_batch", f"{layout} layout: largest batch meeting target", b, "requests", "", "",
              note=f"t_x = {num(d.exchange_s(layout))} s" if layout == "requests" else ""),
            Q(f"{layout}_layout_tokens_per_s", f"{layout} layout: throughput at that batch",
              b / step.total_s if b else 0.0, "tok/s", "B/t_step", f"{b}/{num(step.total_s)}"),
        ]
    return out
