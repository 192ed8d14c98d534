"""The start-up freeze keeps the engine's objects out of collections, and thawing makes a
dropped engine's cycles collectable again (the server's restart, bench commands in tests)."""

import gc
import weakref

from kvserve.engine.gc_policy import freeze_after_startup, thaw


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_cycles_survive_collections_until_thawed():
    obj = _Cycle()
    ref = weakref.ref(obj)
    freeze_after_startup()
    try:
        assert gc.get_freeze_count() > 0
        del obj
        gc.collect()
        assert ref() is not None  # frozen: a collection does not walk it
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # thawed: the cycle is garbage again
