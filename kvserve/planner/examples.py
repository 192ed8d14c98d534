"""Every worked example of the seed, recomputed from its stated inputs.

Each row holds the seed's value as written, the computed one, and the reading taken
where the seed leaves an input implicit. A number matches when it rounds to the digits
the seed states; a qualitative claim ("no", "network", "halves") matches when the
computed verdict starts with it. Rows without a seed value (its formula blocks were
stripped, or it states a formula only) are shown with match "—" and never fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvserve.planner import attention, capacity, disagg, kv, latency, roofline
from kvserve.planner.hardware import PRESETS as CHIPS
from kvserve.planner.inputs import PlanInputs
from kvserve.planner.models import PRESETS as MODELS
from kvserve.planner.plan import make_plan

KIB, GIB, GB, MS = 2**10, 2**30, 1e9, 1e-3


@dataclass(frozen=True)
class Example:
    section: str
    quantity: str
    seed: str  # as the seed states it
    computed: float | str  # in the seed's unit
    expected: float | str | None = None  # None: nothing stated to compare with
    decimals: int = 0  # digits the seed states, for numbers
    reading: str = ""
    unit: str | None = None  # defaults to the unit written after the seed's value

    @property
    def match(self) -> bool | None:
        if self.expected is None:
            return None
        if isinstance(self.expected, str):
            return str(self.computed).startswith(self.expected)
        tolerance = 0.5 * 10**-self.decimals
        return abs(self.computed - self.expected) <= tolerance * (1 + 1e-9)

    @property
    def computed_text(self) -> str:
        if isinstance(self.computed, str):
            return self.computed
        text = f"{self.computed:.{self.decimals + 2}f}".rstrip("0").rstrip(".")
        words = re.sub(r"\(.*?\)", "", self.seed).split()  # the seed's unit, without its asides
        unit = words[-1] if len(words) > 1 and not words[-1][0].isdigit() else ""
        unit = unit if self.unit is None else self.unit
        return f"{text} {unit}".rstrip()

    def as_json(self) -> dict:
        return {"section": self.section, "quantity": self.quantity, "seed": self.seed, "computed": self.computed,
                "computed_text": self.computed_text, "match": self.match, "reading": self.reading}


def _verdict(ratio: float, names: dict[float, str]) -> str:
    for value, name in names.items():
        if abs(ratio - value) < 1e-9:
            return name
    return f"×{ratio:g}"


def seed_70b_inputs(**changes) -> PlanInputs:
    """§5–§6: 70B, int8 weights and KV, 16 seed chips with 2 GB reserved, 12 ms target."""
    base = PlanInputs(
        MODELS["seed-70b"], CHIPS["seed"], num_chips=16, bytes_per_weight=1, bytes_per_kv_element=1,
        reserved_bytes_per_chip=2e9, history_positions=8192, prompt_positions=8192, step_target_s=0.012,
    )
    return replace(base, **changes)


def section_2_3() -> list[Example]:
    c_kv = kv.kv_bytes_per_position(32, 8, 128, 2)
    shape = attention.attention_weight_shape(3, 4)
    g = MODELS["seed-8b"].arch.queries_per_kv_head
    return [
        Example("§2", "attention weights, cached abc + new xefg", "[4, 7]", f"[{shape[0]}, {shape[1]}]", "[4, 7]"),
        Example("§3", "c_kv: 32 layers, 8 KV heads, H=128, bf16", "128 KiB", c_kv / KIB, 128),
        Example("§3", "6 requests, 4096 shared + 1024 private: stored", "1.25 GiB",
                kv.shared_prefix_stored_bytes(6, 4096, 1024, c_kv) / GIB, 1.25, 2),
        Example("§3", "same, old KV read per step scanning per request", "3.75 GiB",
                kv.shared_prefix_read_bytes(6, 4096, 1024, c_kv) / GIB, 3.75, 2),
        Example("§3", "same, read once: each shared block loaded once per step", "1.25 GiB",
                kv.shared_prefix_read_once_bytes(6, 4096, 1024, c_kv) / GIB, 1.25, 2,
                reading="the seed's remedy: load a shared block once, let every request's queries use it"),
        Example("§3", "reusable prefix: cached abcdef, new abcxefg", "3 (abc)", kv.reusable_prefix_positions("abcdef", "abcxefg"), 3),
        Example("§3", "GQA attention intensity, bf16, g Query per KV head", "≈ g = 4 FLOP/B",
                kv.gqa_intensity_flops_per_byte(g, 2), float(g), 0, reading="g = 32/8 = 4 for the §3 model's LLaMA 3-8B shape"),
    ]


def section_4() -> list[Example]:
    prefill = latency.prefill_time_s(70e9, 8192, 16, 197e12, 0.4)
    e = latency.optimisation_effect(0.400, 0.020, 101)
    pairs_one, pairs_two = attention.causal_pairs(8192), attention.independent_sequences_pairs(8192, 2)
    b_star = roofline.critical_batch(1.97e14, 8.2e11, 2)
    return [
        Example("§4", "prefill 2PS/(NCη): P=70e9, S=8192, N=16, C=197e12, η=0.4", "0.91 s (book)", prefill, 0.91, 2,
                reading="the seed's value went with its formula block; the book states 0.91 s and §7 uses 0.90 s"),
        Example("§4", "400 ms prefill, 20 ms steps, 101 tokens: total", "2.4 s", e.total_s, 2.4, 1,
                reading="total = t_prefill + (N_out − 1)·t_step"),
        Example("§4", "prefill halved: TTFT", "200 ms", e.halved_prefill_ttft_s / MS, 200),
        Example("§4", "prefill halved: total", "2.2 s", e.halved_prefill_total_s, 2.2, 1),
        Example("§4", "decode halved: TTFT", "400 ms", e.halved_decode_ttft_s / MS, 400),
        Example("§4", "decode halved: total", "1.4 s", e.halved_decode_total_s, 1.4, 1),
        Example("§4", "one 8192 sequence vs two 4096: projection work", "same",
                "same" if latency.prefill_projection_flops(1, 8192) == 2 * latency.prefill_projection_flops(1, 4096) else "differs", "same"),
        Example("§4", "one 8192 sequence vs two 4096: causal pairs per head", "differ",
                f"differ ({pairs_one:,} vs {pairs_two:,})" if pairs_one != pairs_two else "same", "differ"),
        Example("§4", "critical batch when only p_w halves", "halves",
                _verdict(roofline.critical_batch(1.97e14, 8.2e11, 1) / b_star, {0.5: "halves", 1.0: "unchanged"}), "halves"),
        Example("§4", "critical batch when p_w halves and C doubles", "unchanged",
                _verdict(roofline.critical_batch(2 * 1.97e14, 8.2e11, 1) / b_star, {0.5: "halves", 1.0: "unchanged"}), "unchanged"),
    ]


def section_5() -> list[Example]:
    plan = make_plan(seed_70b_inputs(batch=64))
    p = plan.derived.placement()
    per_chip_at_64 = p.weight_bytes_per_chip + p.kv_allocated_bytes_on_busiest_chip(64)
    fits = plan["fits_memory"]
    requests_share = plan.derived.placement("requests").kv_bytes_per_request_per_chip
    return [
        Example("§5", "c_kv: 70B int8 (80 layers, 8 KV heads, H=128, 1 B)", "160 KiB", plan["kv_bytes_per_position"] / KIB, 160),
        Example("§5", "KV per request at 8192 positions", "1.25 GiB", plan["kv_bytes_per_request"] / GIB, 1.25, 2),
        Example("§5", "same in GB", "1.342 GB", plan["kv_bytes_per_request"] / GB, 1.342, 3),
        Example("§5", "heads layout, 16 chips: share of logical KV per chip", "1/8",
                f"1/{round(1 / p.kv_fraction_per_chip)}", "1/8"),
        Example("§5", "B=64 on 16 GB chips with 2 GB reserved: fits?", "no",
                f"{'yes' if fits else 'no'} ({per_chip_at_64 / GB:.3f} GB > {(16e9 - 2e9) / GB:g} GB)", "no"),
        Example("§5", "requests layout vs 1 KV head of every request per chip", "half",
                _verdict(requests_share / p.kv_bytes_per_request_per_chip, {0.5: "half"}), "half"),
    ]


def section_6() -> list[Example]:
    long = make_plan(seed_70b_inputs())
    d = long.derived
    at_57 = d.step(57)
    short = make_plan(seed_70b_inputs(history_positions=2048, prompt_positions=2048))
    at_128 = short.derived.step(128)
    kv_32_long = kv.logical_kv_bytes(8192, d.kv_bytes_per_position, 32)
    kv_128_short = kv.logical_kv_bytes(2048, d.kv_bytes_per_position, 128)
    return [
        Example("§6", "weights per chip", "4.375 GB", long["weight_bytes_per_chip"] / GB, 4.375, 3),
        Example("§6", "local KV per request per chip, S=8192", "0.16777216 GB", long["kv_bytes_per_request_per_chip"] / GB, 0.16777216, 8),
        Example("§6", "capacity-limited batch, S=8192", "57", long["capacity_batch"], 57),
        Example("§6", "critical batch (int8 weights, bf16 compute)", "≈120.1", long["critical_batch"], 120.1, 1),
        Example("§6", "step time at B=57", "≈17.0 ms", at_57.total_s / MS, 17.0, 1),
        Example("§6", "branch at B=57", "weight-read", at_57.branch, "weight-read"),
        Example("§6", "largest integer batch meeting 12 ms", "32", long["max_batch_meeting_target"], 32),
        Example("§6", "its step time", "≈11.883 ms", long["step_s"] / MS, 11.883, 3),
        Example("§6", "its system throughput", "≈2693 tokens/s", long["tokens_per_s"], 2693, 0),
        Example("§6", "S=2048: KV per request vs S=8192", "1/4",
                f"1/{round(d.kv_bytes_per_request / short.derived.kv_bytes_per_request)}", "1/4"),
        Example("§6", "B=32→128 with S=8192→2048: KV bytes", "same", "same" if kv_32_long == kv_128_short else "differ", "same"),
        Example("§6", "B=32→128: projection work", "4×", f"{at_128.projection_compute_s / d.step(32).projection_compute_s:g}×", "4×"),
        Example("§6", "S=2048, B=128: branch", "compute", at_128.branch, "compute"),
        Example("§6", "S=2048, B=128: step time", "≈12.232 ms", at_128.total_s / MS, 12.232, 3),
        Example("§6", "S=2048: largest integer batch meeting 12 ms", "125", short["max_batch_meeting_target"], 125),
        Example("§6", "its step time", "≈11.946 ms", short["step_s"] / MS, 11.946, 3),
        Example("§6", "its system throughput", "≈10464 tokens/s", short["tokens_per_s"], 10464, 0),
        Example("§6", "S=2048: capacity-limited batch", "229", short["capacity_batch"], 229),
        *_requests_layout(),
    ]


def _requests_layout() -> list[Example]:
    plan = make_plan(seed_70b_inputs(kv_layout="requests", exchange_s_per_step=0.8e-3))
    d = plan.derived
    candidates = (32, 48, 64)  # 2, 3, 4 whole requests on each of the 16 chips
    steps = {b: d.step(b).total_s for b in candidates}
    chosen = max(b for b in candidates if steps[b] <= 0.012)
    heads = make_plan(seed_70b_inputs())
    reading = ("candidates read as B = 32, 48, 64 (2, 3, 4 requests on each of 16 chips, balanced): "
               + ", ".join(f"t({b}) = {steps[b] / MS:.3f} ms" for b in candidates)
               + f"; the busiest-chip model's own largest batch is {plan['max_batch_meeting_target']}")
    more = chosen / steps[chosen]
    return [
        Example("§6", "requests layout + 0.8 ms exchange: chosen batch", "48", chosen, 48, reading=reading),
        Example("§6", "its throughput vs the heads layout's", "higher",
                f"{'higher' if more > heads['tokens_per_s'] else 'lower'} ({more:.1f} vs {heads['tokens_per_s']:.1f} tok/s)", "higher"),
    ]


def section_7() -> list[Example]:
    prefill_s, step_s, batch, n_decode = 0.90, 0.011, 48, 512
    decode = disagg.decode_rate_req_per_s(batch, step_s, n_decode)
    handoff = disagg.handoff_bytes_per_request(8192, kv.kv_bytes_per_position(80, 8, 128, 1))
    network = disagg.network_rate_req_per_s(10e9, handoff)
    rates = disagg.StageRates(disagg.prefill_rate_req_per_s(prefill_s, 8), decode, network)
    return [
        Example("§7", "prefill rate per group, 0.90 s each", "≈1.111 req/s", disagg.prefill_rate_req_per_s(prefill_s), 1.111, 3),
        Example("§7", "decode rate, B=48, 11 ms steps, 512 decode steps", "48/0.011/512 req/s", decode, decimals=2,
                reading="the seed's result went with its formula block"),
        Example("§7", "prefill groups to feed one decode group", "8", disagg.prefill_groups_to_feed(decode, prefill_s), 8),
        Example("§7", "4 prefill groups: their limit", "4.444 req/s", disagg.prefill_rate_req_per_s(prefill_s, 4), 4.444, 3),
        Example("§7", "handoff per request (70B int8, 8192 positions)", "1.34217728 GB", handoff / GB, 1.34217728, 8),
        Example("§7", "handoff network at 10 GB/s", "7.45 req/s", network, 7.45, 2,
                reading="the seed's number was stripped; 7.45 is the issue's reading of it"),
        Example("§7", "8 prefill groups + 1 decode group: bottleneck", "network", rates.bottleneck, "network"),
        Example("§7", "bandwidth for 8 req/s", "≈10.737 GB/s", disagg.bandwidth_for_rate(8, handoff) / GB, 10.737, 3),
        Example("§7", "80 ms KV transfer + 20 ms step: first-to-second gap", "100 ms", latency.handoff_gap_s(0.080, 0.020) / MS, 100),
    ]


def section_8() -> list[Example]:
    plan = make_plan(seed_70b_inputs())
    ideal = capacity.ideal_kv_capacity_bytes(16, 16e9, 2e9, 70e9)
    return [
        Example("§8", "ideal KV room N·H_mem − N·R − W for the §6 setup", "formula only", ideal / GB, unit="GB",
                reading="16·16 − 16·2 − 70 GB: 114 requests at 8192, against 57 with the heads layout's replication"),
        Example("§8", "cost per token c·N·t/B, §6 setup at USD 1.20/h", "formula only", plan["cost_per_million_tokens_usd"], decimals=2, unit="USD/Mtok",
                reading="USD per million tokens; price from the book's table, decode devices only"),
    ]


def all_examples() -> list[Example]:
    return [*section_2_3(), *section_4(), *section_5(), *section_6(), *section_7(), *section_8()]
