"""A constrained request's matcher takes each token it samples, and may end the request.

Called by the scheduler for every appended token, exactly once per token: preemption
keeps sampled tokens (recompute rebuilds only their KV), so the matcher never needs to
roll back. Rules, applied to what the ordinary stop rule decided:

- the grammar rejects the token (a bug: the mask forbade it) → abort this request, with
  a logged error; the step goes on for the others;
- the grammar is complete (only an end token may follow) → finish with "stop", also under
  `ignore_eos`, `min_tokens` or when `max_tokens` is reached by that very token: the
  output is whole, and nothing more could be generated.
"""

from __future__ import annotations

import logging

from kvserve.request_state import RequestStatus

logger = logging.getLogger(__name__)

Stop = tuple[RequestStatus, "int | str | None"]


def advance_structured(request, token: int, stop: Stop | None) -> Stop | None:
    """`request` (an engine Request) has just taken `token`; the stop the rules above make of `stop`."""
    matcher = request.structured
    if matcher is None:
        return stop
    # a matcher in its error state still accepts an end token, so the state is checked too
    if not matcher.accept(token) or matcher.error is not None:
        logger.error(
            "request %s: the grammar rejected token %d after %d tokens (%s); aborting it",
            request.request_id,
            token,
            matcher.num_accepted,
            matcher.error,
        )
        return RequestStatus.FINISHED_ABORTED, None
    if matcher.is_terminated and (stop is None or stop[0] == RequestStatus.FINISHED_LENGTH):
        return RequestStatus.FINISHED_STOPPED, None
    return stop
