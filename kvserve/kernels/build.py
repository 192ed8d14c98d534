"""What each kernel build compiles, with which flags, and where it is cached.

One build per ISA level (kvserve/kernels/isa.py), every one from the same sources: the torch
glue (bindings.cpp, linear.cpp, fused_decode.cpp, shared_prefix_decode.cpp, moe_token.cpp,
families.cpp, checks.cpp: no intrinsics), the torch-free kernel core (core/: one source per op family on raw
pointers, written in core/simd.h's vocabulary, which maps it onto the level's instructions) and
its thin torch layer (ops/: one file per family). The `amx` level adds the one family only
it has (core/amx/, ops/amx/: the AMX tile GEMM), in place of ops/absent.cpp's refusals. The
aarch64 levels compile the same sources; simd.h includes core/neon/x86_vocabulary.h there,
which is the core's x86 vector vocabulary written in NEON.

The compiler is given four units a build, not one per file: bindings.cpp alone (the slowest,
pybind11), and each group of sources (the rest of the glue, core/, ops/) as one generated
file that #includes them, so ATen's headers and templates are compiled once a group (a whole
build 117 s -> about 60 s of CPU). The sources are written for it: no two files of a group
share a name at file scope.

A level with nothing of its own runs the build below it (`avx512` runs `avx2`'s). Each
build is compiled with its level's explicit flags (never -march=native) and hidden symbol
visibility (each build is its own module; with the core in `kvserve::<level>` several
builds live in one process), keyed by its sources' bytes, its flags and the checkout's
path, in the kvserve cache folder: the first use of a level builds it, later ones load it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).parent

_GLUE = ("bindings.cpp", "linear.cpp", "fused_decode.cpp", "shared_prefix_decode.cpp", "moe_token.cpp", "families.cpp",
         "checks.cpp")


def openmp_flags(platform: str = sys.platform, torch_dir: Path | None = None,
                 environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, ...], tuple[str, ...]]:  # fmt: skip
    """(compile, link) flags for OpenMP. GCC and LLVM's clang take -fopenmp. Apple's clang (the
    `c++` of macOS) refuses it and takes `-Xclang -fopenmp`, with libomp's header and library
    from elsewhere: the library is torch's own (`torch/lib/libomp.dylib` in its macOS wheels), so
    the process holds one OpenMP runtime, not torch's and a second one; the header is
    `torch/include/omp.h` where the wheel ships it, else Homebrew's libomp (`brew install
    libomp`). Written from those wheels' layout and Apple clang's options, not yet tried on a Mac."""
    if platform != "darwin":
        return ("-fopenmp",), ("-fopenmp",)
    if torch_dir is None:
        import torch

        torch_dir = Path(torch.__file__).parent
    include = torch_dir / "include"
    if not (include / "omp.h").exists():
        include = Path(environ.get("HOMEBREW_PREFIX", "/opt/homebrew")) / "opt" / "libomp" / "include"
    lib = torch_dir / "lib"
    return ("-Xclang", "-fopenmp", f"-I{include}"), (f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}")


_OPENMP_COMPILE, OPENMP_LINK = openmp_flags()
_COMMON_FLAGS = ("-O3", *_OPENMP_COMPILE, "-fvisibility=hidden", "-fvisibility-inlines-hidden")


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One compiled module: the level it targets, its compiler flags, whether it has AMX tiles."""

    level: str
    isa_flags: tuple[str, ...]
    amx: bool = False
    arch: str = "x86_64"  # isa.ARCH_LEVELS' key: which compiler target the flags are for

    def _groups(self) -> dict[str, list[Path]]:
        """The sources compiled as one unit each, by the unit's name (bindings.cpp is apart)."""
        core = sorted((HERE / "core").glob("*.cpp"))
        ops = sorted(p for p in (HERE / "ops").glob("*.cpp") if not (self.amx and p.name == "absent.cpp"))
        if self.amx:
            core += sorted((HERE / "core" / "amx").glob("*.cpp"))
            ops += sorted((HERE / "ops" / "amx").glob("*.cpp"))
        return {"glue": [HERE / n for n in _GLUE[1:]], "core": core, "ops": ops}

    @property
    def sources(self) -> list[Path]:
        """Every source file of the build (its module name hashes them)."""
        return [HERE / _GLUE[0], *(f for files in self._groups().values() for f in files)]

    def compile_units(self, build_dir: Path) -> list[Path]:
        """What the compiler is given: bindings.cpp, then one unit per group of sources, each a
        file in `build_dir` that #includes its group (written once: a rewrite would rebuild it)."""
        units = [HERE / _GLUE[0]]
        for name, files in self._groups().items():
            unit = build_dir / f"unit_{name}.cpp"
            text = "".join(f'#include "{f.resolve()}"\n' for f in files)
            if not unit.exists() or unit.read_text() != text:
                unit.write_text(text)
            units.append(unit)
        return units

    @property
    def headers(self) -> list[Path]:
        dirs = [HERE, HERE / "core", HERE / "core" / "amx", HERE / "core" / "neon", HERE / "ops"]
        return sorted(p for d in dirs for p in d.glob("*.h"))

    @property
    def cflags(self) -> list[str]:
        """The compiler's arguments as a program receives them."""
        ns = self.level.replace("-", "_")
        return [*_COMMON_FLAGS, *self.isa_flags, f'-DKVSERVE_LEVEL_NAME="{self.level}"', f"-DKVSERVE_LEVEL_NS={ns}"]

    @property
    def ninja_cflags(self) -> list[str]:
        """`cflags` as torch's build.ninja must hold them: ninja hands each command to the shell."""
        return [f.replace('"', '\\"') for f in self.cflags]

    def module_name(self) -> str:
        """kvserve_cpu_ops_<level>_<hash>: the hash covers the sources' bytes, the flags and
        where the sources are (torch's build rewrites build.ninja with the source paths, so two
        checkouts sharing one build folder rebuilt it at every switch between them)."""
        h = hashlib.sha256()
        for p in self.sources + self.headers:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        h.update(" ".join(self.cflags).encode())
        h.update(str(HERE.resolve()).encode())
        return f"kvserve_cpu_ops_{self.level.replace('-', '_')}_{h.hexdigest()[:12]}"


_X86_V3 = ("-march=x86-64-v3", "-mtune=generic")
_X86_V4 = ("-march=x86-64-v4", "-mtune=generic")
_AVX512_BF16 = (*_X86_V4, "-mavx512vnni", "-mavx512bf16")
# GCC and clang both take these; Armv8.0-A includes NEON and the fp16 conversions the core uses
_ARMV8 = ("-march=armv8-a",)
_ARM_DOTPROD = ("-march=armv8.2-a+dotprod",)
_ARM_I8MM = ("-march=armv8.2-a+dotprod+i8mm",)

BUILDS: dict[str, KernelBuild] = {
    "avx2": KernelBuild("avx2", _X86_V3),
    "avx512-vnni": KernelBuild("avx512-vnni", (*_X86_V4, "-mavx512vnni")),
    "avx512-bf16": KernelBuild("avx512-bf16", _AVX512_BF16),
    "amx": KernelBuild("amx", (*_AVX512_BF16, "-mamx-tile", "-mamx-bf16"), amx=True),
    "neon": KernelBuild("neon", _ARMV8, arch="aarch64"),
    "neon-dotprod": KernelBuild("neon-dotprod", _ARM_DOTPROD, arch="aarch64"),
    "neon-i8mm": KernelBuild("neon-i8mm", _ARM_I8MM, arch="aarch64"),
}

# the build each level runs: its own, or the one below it where it has nothing of its own
LEVEL_BUILD: dict[str, str] = {
    "avx2": "avx2",
    "avx512": "avx2",  # no family gains over avx2's code from AVX-512 without VNNI yet
    "avx512-vnni": "avx512-vnni",
    "avx512-bf16": "avx512-bf16",
    "amx": "amx",
    "neon": "neon",
    "neon-dotprod": "neon-dotprod",
    "neon-i8mm": "neon-i8mm",
}


def build_for(level: str) -> KernelBuild:
    return BUILDS[LEVEL_BUILD[level]]
