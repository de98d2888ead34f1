"""Memory the plugin's packing frees, given back to the system as it goes.

vLLM loads every checkpoint tensor into its parameters before any layer is processed; the plugin
then packs each layer and frees vLLM's tensors of it. The large ones are separate mappings and
go back to the system when freed, but glibc's allocator serves allocations below its mmap
threshold (which rises to 32 MiB as large blocks are freed) from its heap: a layer's scales, zero
points, act-order indices and dense int4 words. Freed there, between live blocks, they stay
resident, 20-30 MB a Qwen3-30B-A3B layer (1.0-1.4 GB over 48 layers, docs/whole-model.md, "Load
and memory"). glibc's malloc_trim(0) returns the whole free pages inside the heap as well as its
top, so the plugin calls it after each layer it packs. Elsewhere (another C library, or an
allocator preloaded in its place, such as tcmalloc, whose own release applies) it is a no-op.
"""

import ctypes
import ctypes.util

_trim = None


def _malloc_trim():
    """glibc's malloc_trim, or False where the C library has none."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            _trim = False
    return _trim


def release_freed() -> None:
    """Gives the allocator's free pages back to the system (after a layer is packed)."""
    trim = _malloc_trim()
    if trim:
        trim(0)
