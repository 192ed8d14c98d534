"""`python -m tests.support.faulty_server [--fail-after-steps N] [--kv-stall-s S] serve …`: the
normal `kvserve serve`, every engine it builds (the first, and any restart) with a fault
injected, for the tests of whole server processes:

- `--fail-after-steps N`: each engine's step N+1 raises (a real engine failure in the engine thread);
- `--kv-stall-s S`: every handoff arriving at it is held back S seconds (a slow link).
"""

from __future__ import annotations

import argparse
import sys

from kvserve.cli import build_parser
from kvserve.disagg.connector import open_transport
from kvserve.engine.async_engine import AsyncLLMEngine
from tests.support.faults import FailingEngine, FaultyTransport


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--fail-after-steps", type=int, default=None)
    parser.add_argument("--kv-stall-s", type=float, default=0.0)
    faults, rest = parser.parse_known_args(argv)
    args = build_parser().parse_args(rest)

    def build_engine(config) -> AsyncLLMEngine:
        transport = FaultyTransport(open_transport(config), stall_s=faults.kv_stall_s) if faults.kv_stall_s else None
        return AsyncLLMEngine(engine=FailingEngine(config, kv_transport=transport, fail_after_steps=faults.fail_after_steps))

    return args.func(args, build_engine=build_engine)


if __name__ == "__main__":
    sys.exit(main())
