"""What one engine step does, in the quantities its time depends on.

Read from the scheduler's plan right after `Scheduler.schedule()` (before the step's update
moves the requests on), the same way in the engine under calibration and in the simulator,
so the fitted model and the simulated steps see one definition. The shared-prefix grouping
and the count of KV positions read come from the engine's own plan module
(attention/shared_prefix_plan.py, plain Python), so a simulated step reads a shared prefix
once exactly where the engine would and counts it as the engine's counters do.
"""

from __future__ import annotations

import dataclasses

from kvserve.attention.shared_prefix_plan import SharedPrefixRule, find_shared_prefill_prefixes, kv_positions_read


@dataclasses.dataclass(frozen=True)
class StepShape:
    decode_rows: int = 0  # rows computing one position (m = 1)
    prefill_tokens: int = 0  # positions of prompt chunks (m > 1)
    prefill_rows: int = 0  # prompt chunks
    sample_rows: int = 0  # rows that sample a token (an LM-head row each)
    decode_kv_positions: int = 0  # KV positions the decode rows' attention reads (after shared-prefix reads)
    prefill_pairs: int = 0  # (query, key) pairs of the chunks' attention: Σ m·S0 + m(m+1)/2
    prefill_kv_positions: int = 0  # KV positions the chunks' attention reads: Σ S0 + m (after shared reads)
    # not the step's own work: requests the server's event loop took in while the step ran
    # (parsing, validating, opening their streams), on the cores the step computes on
    arrivals: int = 0

    @property
    def mixed_prefill_tokens(self) -> int:
        """Prompt positions in a step that also decodes: such a step runs layer by layer through
        the general path (no fused decode step), and measures dearer per prompt position."""
        return self.prefill_tokens if self.decode_rows else 0

    @property
    def tokens(self) -> int:
        """Rows through the projections: every new position of the step."""
        return self.decode_rows + self.prefill_tokens

    @property
    def rows(self) -> int:
        return self.decode_rows + self.prefill_rows

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def shape_of(plan, block_size: int, shared_prefix: SharedPrefixRule | None = None) -> StepShape:
    """The step a `SchedulerOutput` describes. `shared_prefix`: the rule the engine groups shared
    prefixes with (--shared-prefix-attention auto); None: every row reads its whole history."""
    decode_rows = prefill_tokens = prefill_rows = samples = 0
    decode_kv = prefill_pairs = prefill_kv = 0
    decode_tables, decode_lens, prefill_tables, prefill_cached = [], [], [], []
    for s in plan.scheduled:
        start, m = s.request.num_computed_tokens, s.num_new_tokens
        samples += s.samples
        if m == 1:
            decode_rows += 1
            decode_kv += start + 1
            if shared_prefix is not None:
                decode_tables.append(plan.block_tables[s.request.request_id])
                decode_lens.append(start + 1)
        else:
            prefill_rows += 1
            prefill_tokens += m
            prefill_pairs += m * start + m * (m + 1) // 2
            prefill_kv += start + m
            if shared_prefix is not None:
                prefill_tables.append(plan.block_tables[s.request.request_id])
                prefill_cached.append(start)
    if shared_prefix is not None:
        if len(prefill_tables) > 1:
            prefill_kv = kv_positions_read(
                prefill_kv, prefill_sharing=find_shared_prefill_prefixes(prefill_tables, prefill_cached, block_size)
            )
        if decode_tables:
            decode_kv = kv_positions_read(decode_kv, shared_prefix.plan(decode_tables, decode_lens, block_size))
    return StepShape(decode_rows, prefill_tokens, prefill_rows, samples, decode_kv, prefill_pairs, prefill_kv)
