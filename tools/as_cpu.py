"""Run a command as a CPU of a lower kernel level sees it: an AVX2-only machine's run on one
that has AVX-512 (and AMX).

    sudo python -m tools.as_cpu avx2 -- make test
    sudo python -m tools.as_cpu avx512-vnni -- kvserve bench latency

kvserve reads the CPU's features from /proc/cpuinfo, which Linux already clears for state the
OS did not enable (kvserve/kernels/isa.py), so a CPU whose AVX-512 the hypervisor switched off
looks to kvserve exactly like an AVX2-only one. This tool makes that view: in a mount
namespace of its own (`unshare -m`, root), /proc/cpuinfo is replaced by a copy without the
flags of every level above LEVEL (and, below `avx512`, without any AVX-512, AMX or AVX-VNNI
flag, as on Zen 1-3), and torch is held to the same level (ATEN_CPU_CAPABILITY, and
ONEDNN_MAX_CPU_ISA for oneDNN, which reads CPUID itself). Every process the command starts
(servers, torch.distributed ranks, kernel builds) shares the view.

What it does not emulate: the instructions still run on this CPU, so a lower level's object
that held a higher level's instruction would run here and fault only on the real machine (the
objdump test, tests/kernels/test_isa.py, is what guards that), and the timings are this
machine's cores and memory, not an AVX2-only one's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.kernels import isa

# below avx512 a real CPU has none of these (Zen 1-3; Intel client chips' AVX-VNNI is hidden too,
# as no level reads it)
_FAMILIES_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")

# torch's own level for each kernel level: ATen's dispatch and oneDNN's ISA cap
_TORCH_LEVEL = {
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE"),
    "avx512-vnni": ("avx512", "AVX512_CORE_VNNI"),
    "avx512-bf16": ("avx512", "AVX512_CORE_BF16"),
}


def hidden_flags(level: str, flags: frozenset[str]) -> frozenset[str]:
    """The flags of `flags` a CPU of `level` (an x86 level) would not list."""
    levels = isa.X86_LEVELS
    if level not in levels:
        raise ValueError(f"{level!r} is not an x86 kernel level ({', '.join(levels)})")
    above = {f for lv in levels[levels.index(level) + 1 :] for f in isa.level_flags(lv)}
    if level == "avx2":
        above |= {f for f in flags if f.startswith(_FAMILIES_ABOVE_AVX2)}
    elif level != "amx":
        above |= {f for f in flags if f.startswith("amx")}
    return frozenset(f for f in flags if f in above)


def masked_cpuinfo(text: str, hide: frozenset[str]) -> str:
    """/proc/cpuinfo's text with `hide` taken out of every processor's flags line."""
    out = []
    for line in text.splitlines(keepends=True):
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            kept = " ".join(f for f in value.split() if f not in hide)
            line = f"{key}: {kept}\n"
        out.append(line)
    return "".join(out)


def torch_env(level: str) -> dict[str, str]:
    """The environment that holds torch to `level` (nothing for amx: the CPU's own)."""
    if level not in _TORCH_LEVEL:
        return {}
    aten, onednn = _TORCH_LEVEL[level]
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.as_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("level", choices=isa.X86_LEVELS, help="the kernel level the command's CPU has")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python -m tools.as_cpu LEVEL -- COMMAND [ARG ...]")
    try:  # a level above this CPU's (flags can be hidden, not added), or a machine not x86's
        isa.check_level(args.level, "level")
    except ConfigError as e:
        parser.error(str(e))
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        parser.error("needs root and util-linux's unshare (a mount namespace replaces /proc/cpuinfo)")
    text = Path("/proc/cpuinfo").read_text()
    hide = hidden_flags(args.level, isa.flags_from_cpuinfo(text))
    with tempfile.NamedTemporaryFile("w", prefix="kvserve-cpuinfo-", suffix=".txt", delete=False) as f:
        f.write(masked_cpuinfo(text, hide))
    try:
        held = torch_env(args.level)
        print(f"as_cpu: level {args.level}: /proc/cpuinfo without {len(hide)} flags ({' '.join(sorted(hide)) or 'none'})"
              + "".join(f", {k}={v}" for k, v in held.items()), file=sys.stderr, flush=True)
        # sh's $0 is the copy's path; the command follows as "$@"
        script = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
        return subprocess.call(["unshare", "-m", "--propagation", "private", "sh", "-c", script, f.name, *command],
                               env={**os.environ, **held})
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    sys.exit(main())
