"""The package's rooms import only downwards, and no module imports itself back round a cycle.

`ROOMS` is the order of docs/design.md's map, lowest first: a room may import the rooms
listed before it, never one after it (lazy imports inside functions count too; imports under
`if TYPE_CHECKING:` do not, they never run). A new top-level module or folder must be given
its place here, which is the point: where it sits is a decision, not an accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvserve"

ROOMS = [
    "errors", "paths", "memory", "request_state", "outputs",  # leaves: no kvserve imports but these
    "families",  # what sets each architecture family apart, how its checkpoints name it; torch-free
    "arch", "arch_presets",  # a model's shape, torch-free
    "kernels",  # ISA levels, builds, the compiled ops and what each model may use of them
    "config",  # the engine's validated configuration
    "attention",  # shared-prefix plan, merge maths, KV pools, backends
    "distributed",  # process groups, launch, the TP split, the requests KV layout
    "model",  # loaders, layers, linear methods, the decoder
    "structured", "sampling_params",
    "disagg",  # prefill/decode handoff: connector and transports
    "engine_args", "engine",  # scheduler, KV cache manager, runner, the step
    "loadgen",  # arrivals, a load's client and statistics (bench and sim share it)
    "router", "planner", "sim", "bench", "server",
    "cli_engine", "cli", "__init__",
]  # fmt: skip


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> list[str]:
    """The kvserve modules `path` imports (a `from pkg import sub` names the submodule)."""
    tree = ast.parse(path.read_text())
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvserve":
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            found += subs or [node.module]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "kvserve"]
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in _imports(p, set(paths)) if i != m} for m, p in paths.items()}


def test_every_room_has_its_place():
    rooms = {_room(m) for m in _graph()}
    assert rooms - set(ROOMS) == set(), "give each new room its place in ROOMS (and docs/design.md)"
    assert set(ROOMS) - rooms == set(), "a room in ROOMS no longer exists"


def test_rooms_import_only_rooms_below_them():
    rank = {r: i for i, r in enumerate(ROOMS)}
    upward = sorted(
        f"{m} imports {i}"
        for m, imports in _graph().items()
        for i in imports
        # the package root (its __version__) runs before any module of it anyway
        if i != "kvserve" and rank[_room(i)] > rank[_room(m)]
    )
    assert upward == []


def test_no_module_is_part_of_an_import_cycle():
    graph = _graph()
    cycles = []
    for start in graph:
        # depth-first from `start`, back to `start`
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []
