"""A plan: every quantity of the seed's arithmetic for one `PlanInputs`, with formulas.

`make_plan` derives the shared figures once (`Derived`: c_kv, the placement, capacity,
the batch used for decode, its step time, prefill time) and then asks each section
module for its quantities. Nothing is cached across plans, so changing any input
re-derives everything that depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kvserve.errors import ConfigError
from kvserve.planner import capacity, kv, latency, moe, roofline, sections_memory, sections_serving, weight_shares
from kvserve.planner.inputs import PlanInputs
from kvserve.planner.layout import Placement, place
from kvserve.planner.quantity import Quantity, Section
from kvserve.planner.weight_shares import ShareUnknown, WeightShare


@dataclass
class Derived:
    """Figures several sections share, computed once per plan."""

    inputs: PlanInputs
    _shares: dict = field(default_factory=dict, repr=False)

    def weight_share(self, num_chips: int | None = None) -> WeightShare | str:
        """The busiest chip's exact weight share on `num_chips` chips (default N) as the engine
        splits the model (weight_shares.py), or why it is unknown (then W/N stands in)."""
        n = num_chips or self.inputs.num_chips
        if n not in self._shares:
            self._shares[n] = _weight_share(self.inputs, n)
        return self._shares[n]

    @cached_property
    def kv_bytes_per_position(self) -> float:
        return self.inputs.model.arch.kv_bytes_per_position(self.inputs.bytes_per_kv_element, self.inputs.kv_scale_bytes)

    @cached_property
    def held_positions(self) -> float:
        """S, or with sliding-window layers the positions a request keeps per layer on average."""
        return kv.held_positions(self.inputs.history_positions, self.inputs.model.arch.layer_windows)

    @cached_property
    def kv_bytes_per_request(self) -> float:
        return self.held_positions * self.kv_bytes_per_position

    @cached_property
    def kv_bytes_per_request_allocated(self) -> float:
        i = self.inputs
        return kv.held_positions_paged(i.history_positions, i.model.arch.layer_windows, i.kv_block_positions) * self.kv_bytes_per_position

    @cached_property
    def experts(self) -> moe.ExpertShape | None:
        """A mixture of experts' shape (planner/moe.py), None for a dense model."""
        return moe.expert_shape(self.inputs.model.arch, self.inputs.model.num_params)

    @cached_property
    def active_params(self) -> float:
        """The parameters each token multiplies: P, or a mixture of experts' P_active."""
        return self.inputs.model.num_params if self.experts is None else self.experts.active_params

    @cached_property
    def weight_bytes(self) -> float:
        return self.inputs.model.num_params * self.inputs.bytes_per_weight

    def placement(self, layout: str | None = None, num_chips: int | None = None, read_once: bool | None = None) -> Placement:
        """`read_once`: whether a step reads the shared prefix once (default: the inputs' choice)."""
        i = self.inputs
        read_once = i.reads_shared_prefix_once if read_once is None else read_once
        share = self.weight_share(num_chips)
        return place(
            layout or i.kv_layout, num_chips or i.num_chips, i.model.num_params, i.bytes_per_weight,
            i.model.arch.num_kv_heads, self.kv_bytes_per_request, self.kv_bytes_per_request_allocated,
            i.shared_prefix_positions * self.kv_bytes_per_position if read_once else 0.0,
            share.weight_bytes if isinstance(share, WeightShare) else None,
        )

    def exchange_s(self, layout: str) -> float:
        return self.inputs.exchange_s_per_step if layout == "requests" else 0.0

    def capacity_batch(self, layout: str | None = None) -> int:
        i = self.inputs
        return capacity.capacity_batch(i.chip.hbm_bytes, i.reserved_bytes_per_chip, self.placement(layout))

    def max_batch_meeting_target(self, layout: str | None = None) -> int:
        i, layout = self.inputs, layout or self.inputs.kv_layout
        return capacity.max_batch_meeting_target(
            self.placement(layout), self.capacity_batch(layout), i.step_target_s,
            i.chip.peak_flops_per_s, i.chip.hbm_bytes_per_s, self.exchange_s(layout), self.experts,
        )

    def step(
        self, batch: int, layout: str | None = None, num_chips: int | None = None, read_once: bool | None = None,
    ) -> roofline.StepTime:
        layout = layout or self.inputs.kv_layout
        return roofline.step_time(
            self.placement(layout, num_chips, read_once), batch, self.inputs.chip.peak_flops_per_s,
            self.inputs.chip.hbm_bytes_per_s, self.exchange_s(layout), self.experts,
        )

    @cached_property
    def decode_batch(self) -> int:
        """--batch if given, else the largest batch meeting the target, else 1 (flagged)."""
        return self.inputs.batch or self.max_batch_meeting_target() or 1

    @cached_property
    def decode_batch_note(self) -> str:
        if self.inputs.batch:
            return "the --batch you gave"
        if self.capacity_batch() == 0:
            return "weights alone do not fit the chips: B=1 shown only to keep the arithmetic going"
        if self.max_batch_meeting_target() == 0:
            return "no batch meets the step target: B=1 shown"
        return "the largest batch meeting the step target"

    @cached_property
    def decode_step(self) -> roofline.StepTime:
        return self.step(self.decode_batch)

    @cached_property
    def prefill_s(self) -> float:
        i = self.inputs
        return latency.prefill_time_s(self.active_params, i.prompt_positions, i.num_chips, i.chip.peak_flops_per_s, i.utilisation)


def _weight_share(inputs: PlanInputs, num_chips: int) -> WeightShare | str:
    m = inputs.model
    if not m.architecture_known:
        return "the model's full shape is unknown (tied embeddings not stated: a round P, a custom or overridden shape)"
    try:
        storage = weight_shares.storage_for(inputs.weight_format, inputs.bytes_per_weight, m.stored_bytes_per_weight)
        return weight_shares.weight_share(m.arch, num_chips, storage)
    except ShareUnknown as exc:
        return str(exc)


@dataclass
class Plan:
    inputs: PlanInputs
    sections: list[Section]
    derived: Derived = field(repr=False)

    def quantity(self, key: str) -> Quantity:
        for section in self.sections:
            for q in section.quantities:
                if q.key == key:
                    return q
        raise KeyError(key)

    def __getitem__(self, key: str):
        return self.quantity(key).value

    def as_json(self) -> dict:
        quantities = {}
        for section in self.sections:
            for q in section.quantities:
                quantities[q.key] = q.as_json(section.key)
        return {
            "kvserve_plan_version": 1,
            "inputs": self.inputs.as_json(),
            "sections": [{"key": s.key, "title": s.title, "keys": [q.key for q in s.quantities]} for s in self.sections],
            "quantities": quantities,
        }


def make_plan(inputs: PlanInputs) -> Plan:
    if not isinstance(inputs, PlanInputs):
        raise ConfigError("inputs", f"must be a PlanInputs, got {type(inputs).__name__}")
    derived = Derived(inputs)
    sections = [*sections_memory.build(derived), *sections_serving.build(derived)]
    return Plan(inputs=inputs, sections=sections, derived=derived)
