"""Rendering plans and the worked-examples table: rich tables for people, JSON for programs."""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvserve.planner.examples import Example
from kvserve.planner.plan import Plan
from kvserve.planner.quantity import num, show

JSON_VERSION = 1


def _named(name: str | None) -> str:
    return f" ({name})" if name else ""


def _inputs_table(plan: Plan) -> Table:
    i, m, c = plan.inputs, plan.inputs.model, plan.inputs.chip
    a = m.arch
    price = "n/a" if c.cost_usd_per_chip_s is None else f"{c.cost_usd_per_chip_s * 3600:g} USD/h"
    rows = [
        ("model", f"{m.name}: L={a.num_layers} D={a.hidden_size} F={a.intermediate_size} N_q={a.num_heads} "
                  f"N_kv={a.num_kv_heads} H={a.head_dim} V={a.vocab_size} P={num(m.num_params)}"),
        ("chip", f"{c.name}: HBM {show(c.hbm_bytes, 'B')}, β {show(c.hbm_bytes_per_s, 'B/s')}, "
                 f"C {num(c.peak_flops_per_s)} FLOP/s, {price}, link {show(c.link_bytes_per_s, 'B/s')} α {show(c.link_latency_s, 's')}"),
        ("deployment", f"N={i.num_chips} chips, layout {i.kv_layout}, p_w={num(i.bytes_per_weight)} B{_named(i.weight_format)}, "
                       f"p_kv={num(i.bytes_per_kv_element)} B{_named(i.kv_cache_dtype)}"
                       f"{f' + {num(i.kv_scale_bytes)} B scale per KV head' if i.kv_scale_bytes else ''}, "
                       f"p_a={num(i.bytes_per_activation)} B, "
                       f"R={show(i.reserved_bytes_per_chip, 'B')}/chip, t_x={show(i.exchange_s_per_step, 's')}"),
        ("workload", f"S={i.history_positions} history, {i.prompt_positions} prompt, N_out={i.output_tokens}, "
                     f"target {show(i.step_target_s, 's')}/step, η={num(i.utilisation)}, page {i.kv_block_positions} positions"),
        ("disaggregation", f"{i.prefill_groups} prefill group(s), handoff {show(i.handoff_bytes_per_s, 'B/s')}"),
    ]
    table = Table(title="Inputs", box=box.SIMPLE_HEAD, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    notes = [n for n in (m.note, c.note) if n]
    if notes:
        table.add_row("", Text("; ".join(notes), style="dim"))
    return table


def render_plan(plan: Plan, console: Console, explain: bool = False) -> None:
    console.print(_inputs_table(plan))
    for section in plan.sections:
        table = Table(title=section.title, box=box.SIMPLE_HEAD, title_justify="left")
        table.add_column("quantity")
        table.add_column("value", justify="right")
        if explain:
            table.add_column("formula")
            table.add_column("with numbers")
        else:
            table.add_column("note", style="dim")
        for q in section.quantities:
            value = show(q.value, q.unit)
            if explain:
                formula = Text(q.formula)
                if q.note:
                    formula.append(f"\n{q.note}", style="dim")
                table.add_row(q.label, value, formula, q.substituted)
            else:
                table.add_row(q.label, value, q.note)
        console.print(table)


def render_examples(examples: list[Example], console: Console) -> None:
    """The table, with each reading taken as a numbered note under it (keeps rows one line)."""
    table = Table(title="Worked examples of the seed, recomputed", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("§", "quantity", "seed", "computed", "match", "note"):
        table.add_column(name, overflow="fold")
    readings: list[str] = []
    for e in examples:
        mark = {True: Text("yes", style="green"), False: Text("NO", style="bold red"), None: Text("—")}[e.match]
        ref = ""
        if e.reading:
            readings.append(e.reading)
            ref = f"[{len(readings)}]"
        table.add_row(e.section, e.quantity, e.seed, e.computed_text, mark, ref)
    console.print(table)
    for n, reading in enumerate(readings, 1):
        console.print(f"[{n}] {reading}", markup=False, highlight=False)
    checked = [e for e in examples if e.match is not None]
    failed = [e for e in checked if not e.match]
    console.print(f"{len(checked) - len(failed)}/{len(checked)} stated values match; "
                  f"{len(examples) - len(checked)} rows have no stated value to compare.")


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.as_json(), indent=2, default=str)


def examples_json(examples: list[Example]) -> str:
    checked = [e for e in examples if e.match is not None]
    return json.dumps({
        "kvserve_examples_version": JSON_VERSION,
        "all_match": all(e.match for e in checked),
        "examples": [e.as_json() for e in examples],
    }, indent=2)
