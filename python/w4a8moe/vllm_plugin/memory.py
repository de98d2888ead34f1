"""The memory of the layers w4a8moe takes: huge pages for what vLLM loads into them, and what
the packing frees given back to the system as it goes.

Huge pages: vLLM creates a layer's parameters empty (no page touched yet) and its loader then
copies the checkpoint into them, 4 KiB page by page: a page fault and a TLB entry every 4 KiB,
over the whole model (16.6 GB of Qwen3-30B-A3B GPTQ), and the packing reads them all again.
Linux's default transparent-huge-page mode ("madvise") gives 2 MiB pages to the ranges a
process asks for; the plugin asks for its layers' large parameters before they are loaded
(docs/vllm.md, "Load"). A hint only: where the kernel has no huge page free, or THP is off, the
pages are 4 KiB as before; and a parameter vLLM creates zero-filled (gpt-oss's MXFP4 method
does) has its pages already, so the hint cannot reach it.

Freed memory:

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
import mmap

_HUGE_PAGE = 2 << 20
_trim = None
_madvise = None


def _libc(name: str, argtypes, restype=ctypes.c_int):
    """The C library's function `name`, or False where the C library has none."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return False
    function.argtypes, function.restype = argtypes, restype
    return function


def _malloc_trim():
    """glibc's malloc_trim, or False where the C library has none."""
    global _trim
    if _trim is None:
        _trim = _libc("malloc_trim", [ctypes.c_size_t])
    return _trim


def release_freed() -> None:
    """Gives the allocator's free pages back to the system (after a layer is packed)."""
    trim = _malloc_trim()
    if trim:
        trim(0)


def _libc_madvise():
    """libc's madvise, or False where there is none (or no MADV_HUGEPAGE)."""
    global _madvise
    if _madvise is None:
        _madvise = getattr(mmap, "MADV_HUGEPAGE", None) is not None and _libc(
            "madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    return _madvise


def huge_pages(layer) -> None:
    """Asks for transparent huge pages under the layer's own parameters of 2 MiB or more, before
    vLLM loads them (the pages a parameter already has keep their size)."""
    advise = _libc_madvise()
    if not advise:
        return
    page = mmap.PAGESIZE
    for param in layer.parameters(recurse=False):
        if param.device.type != "cpu" or param.nbytes < _HUGE_PAGE:
            continue
        start = param.data_ptr()
        first, end = -(-start // page) * page, (start + param.nbytes) // page * page
        if end > first:
            advise(first, end - first, mmap.MADV_HUGEPAGE)  # a hint: its result is not needed
