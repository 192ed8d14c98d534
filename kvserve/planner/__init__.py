"""The planner: the seed's inference arithmetic for any model and chip.

    from kvserve.planner import PlanInputs, make_plan, MODEL_PRESETS, CHIP_PRESETS
    plan = make_plan(PlanInputs(MODEL_PRESETS["seed-8b"], CHIP_PRESETS["h100"], num_chips=4))
    plan["max_batch_meeting_target"], plan.quantity("step_s").substituted

The formulas live in small modules (kv, attention, latency, layout, roofline, capacity,
parallel, disagg, cost) as plain functions; `make_plan` assembles them with their
formulas for `kvserve plan run`, and `examples` checks them against the seed.
"""

from kvserve.planner.hardware import PRESETS as CHIP_PRESETS
from kvserve.planner.hardware import Chip, get_chip
from kvserve.planner.inputs import PlanInputs
from kvserve.planner.models import PRESETS as MODEL_PRESETS
from kvserve.planner.models import PlannedModel, from_gguf, from_hf_config, load_model
from kvserve.planner.plan import Plan, make_plan

__all__ = [
    "CHIP_PRESETS", "Chip", "get_chip", "PlanInputs", "MODEL_PRESETS", "PlannedModel", "from_gguf",
    "from_hf_config", "load_model", "Plan", "make_plan",
]
