"""The `kvserve` command: serve | chat | generate | bench | plan | router | sim.

Each subcommand lives in its own module and registers itself through
`register(subparsers)`; the parser sets `func`, which returns an exit status.
User errors (typed `KVServeError`) print one clear line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvserve.errors import KVServeError

# (module, what it adds); imported lazily so `kvserve plan` never loads torch models.
_SUBCOMMAND_MODULES = (
    "kvserve.cli_engine",  # generate, chat
    "kvserve.server.cli",  # serve
    "kvserve.bench.cli",  # bench latency | throughput | serve
    "kvserve.planner.cli",  # plan …
    "kvserve.router.cli",  # router
    "kvserve.sim.cli",  # sim
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="LLM inference engine, OpenAI-compatible server and inference planner.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that subcommand is not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvserve … | head` closed the pipe: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
