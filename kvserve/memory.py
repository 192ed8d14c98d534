"""glibc malloc settings for a process that allocates and frees tensor-sized buffers every step:
the engine fixes the thresholds at start-up, the model loaders and the model hand freed pages back.
Below both (model/ may not import engine/).

glibc serves a request above its mmap threshold with a fresh mapping and unmaps it on free,
and raises that threshold to the size of each mapped chunk freed; its heap is trimmed back
to the OS whenever the free top exceeds the trim threshold. A prefill step allocates tens of
megabytes of activations per layer ([2048, 3072] bf16 is 12 MiB), so depending on the order
of earlier frees every one of them may be faulted in page by page again: six 2048-token
prefills of SmolLM2 took 450,000-750,000 minor faults, and 11,500 with the thresholds fixed
(getrusage around the prefills). `KVSERVE_MALLOC_TUNING=1` against `=0`, alternating, Zen 4:
`kvserve bench latency --prompt-lens 2048 --prefill-iters 5 --decode-steps 16` gave 1,223 /
1,277 against 1,099 / 1,174 prefill tok/s (82% / 86% of the roofline against 77% / 79%).
Fixing the thresholds keeps freed buffers in the heap for the next step; peak RSS of
`kvserve bench throughput` did not move (2,184 MiB with and without; 1,121 against
1,064 total tok/s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above half its 64 MiB heap size (64-bit)
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, loaded once: find_library runs ldconfig (1.2 ms a call), and the loader
    trims after every tensor."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds, once per process; False where this is not glibc
    or `KVSERVE_MALLOC_TUNING=0`. Variables the user set (MALLOC_*_THRESHOLD_) win."""
    if os.environ.get("KVSERVE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # musl and others: no mallopt
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        logger.info("glibc refused the malloc thresholds; keeping its defaults")
    return ok


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc malloc_trim), once the weights are
    loaded. Repacking a GGUF leaves freed transients between the packed weights that the
    trim threshold never reaches: a Llama-3.1-8B-shape Q4_K_M held 4,904 MiB of weights at
    8,972 MB RSS before this, its Q4_0 (no transients of that size) at 4,397 MB."""
    trim = getattr(_libc(), "malloc_trim", None) if sys.platform.startswith("linux") else None
    return bool(trim(0)) if trim is not None else False


def lazily_zeroed(shape: tuple[int, ...], dtype):
    """A CPU tensor of zeros whose pages the kernel supplies as they are first written, from an
    anonymous mapping (zero-filled by definition) asked for transparent huge pages: the KV
    pool. `torch.zeros` wrote every page of it at start-up, so a 1 GiB pool was 1 GiB of RSS
    before the first request; a mapping holds only the blocks requests have used (and reads of
    a block never written, such as the null block, see zeros)."""
    import math
    import mmap

    import torch

    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer TLB misses for attention's reads, which jump between blocks
        buf.madvise(mmap.MADV_HUGEPAGE)
    # torch keeps the mapping alive as long as the tensor (frombuffer holds a reference to it)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
