"""Python's cyclic garbage collector and a long-lived engine.

A collection of the oldest generation walks every container object the process holds, and
after start-up those are mostly the engine's own (modules, the model's parameters and
layers, the tokenizer): a decode step allocates enough small objects to trigger
collections, and they showed as 3-5% of the engine thread's time (perf, default model,
batch 1). Freezing what exists once the engine is built moves it out of every later
collection, as vLLM's engine core does after start-up; what requests allocate is still
collected as before.

Frozen objects are never collected, so a process that drops an engine and builds another
(the server's restart after an engine failure) thaws them first: the old engine's cycles
become collectable again and the new engine is frozen once built.
"""

import gc


def freeze_after_startup() -> None:
    """Collect what start-up left behind, then keep everything alive now out of later collections."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Make the frozen objects collectable again (before dropping an engine)."""
    gc.unfreeze()
