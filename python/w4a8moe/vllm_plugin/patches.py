"""The ledger of vLLM's symbols the plugin patches, and the only code that patches them.

Each entry of LEDGER names one attribute of one of vLLM's modules or classes, the plugin module
that patches it, what the plugin puts there, why, and the vLLM release whose code the entry was
read from. The family modules patch through replace() and edit() below, which refuse a symbol the
ledger does not list and record what they did (applied()), so that the ledger cannot drift from
the code; the plugin's tests check that what an install changes in vLLM is exactly the ledger.
For a new vLLM release, each entry is a place to read again.

Every function replacement keeps vLLM's own function and calls it for what w4a8moe does not take
(core.wrap): vLLM's behaviour outside w4a8moe's layers is unchanged.
"""

import importlib
from typing import Callable, Dict, NamedTuple, Tuple

#: The vLLM release the entries were read from (core.SUPPORTED_VLLM's lower end).
READ_FROM = "0.32.0"


class Patch(NamedTuple):
    module: str  # vLLM's module
    attribute: str  # the attribute patched: "name" or "Class.name"
    by: str  # the plugin module that patches it
    what: str  # what the plugin puts there
    why: str
    vllm: str = READ_FROM


_CT_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
_W4A8 = f"{_CT_MOE}.compressed_tensors_moe_w4a8_int8"
_CT_WNA16 = f"{_CT_MOE}.compressed_tensors_moe_wna16"
_GPTQ = "vllm.model_executor.layers.quantization.auto_gptq"
_AWQ = "vllm.model_executor.layers.quantization.auto_awq"
_MXFP4 = "vllm.model_executor.layers.quantization.mxfp4"
_CT_DENSE = ("vllm.model_executor.layers.quantization.compressed_tensors.schemes."
             "compressed_tensors_wNa16")
_UTILS = "vllm.model_executor.layers.utils"

_SELECT = ("vLLM's choice of a MoE layer's experts kernel, where no backend runs on most CPUs: "
           "w4a8moe is asked first, and a refusal (with its reason in the log) falls through "
           "to vLLM's own choice")
_PROCESS = ("a layer w4a8moe took holds the checkpoint's tensors as vLLM loaded them: they are "
            "packed for w4a8moe's op and freed (vLLM's own method would repack them for its "
            "kernel); vLLM's method runs for the other layers")
_WNA16_INIT = ("the method's quantization scheme is read once for w4a8moe; compressed-tensors "
               "asserts that a non-Marlin backend is grouped, so a channel-wise layer is passed "
               "to it as one group of the whole row and its strategy put back")
_WNA16_CREATE = ("a layer w4a8moe took gets its scales in float32 and NaN until loaded (exact "
                 "bfloat16 / float16 scales, a missing one seen), a loader of its zero points "
                 "that records the experts it filled, and huge pages for its large tensors "
                 "before they load (memory.py)")
_HUGE_PAGES = ("vLLM creates the layer's tensors untouched and copies the checkpoint into them "
               "4 KiB page by page; 2 MiB pages, asked for first, spare most of the page faults "
               "and TLB misses of that copy and of the packing that reads it (memory.py)")
_DENSE_CREATE = ("a dense int4 layer w4a8moe's linear kernel took gets huge pages and loads its "
                 "scales in float32 (GPTQ's float16 scales would be rounded to the model's "
                 "dtype) and NaN until loaded (a scale the file lacks is an error naming the "
                 "layer)")

LEDGER: Tuple[Patch, ...] = (
    Patch(_W4A8, "select_w4a8_int8_moe_backend", "w4a8",
          "w4a8moe's selection, then vLLM's", _SELECT),
    Patch(_W4A8, "CompressedTensorsW4A8Int8MoEMethod.create_weights", "w4a8",
          "vLLM's, then for w4a8moe's layers scales filled with NaN and pack-quantized "
          "weight_packed / weight_shape tensors registered, and huge pages asked for",
          "vLLM starts scales at 1, so a scale missing from the file would run as 1; vLLM's "
          "W4A8 method registers only int8 weights and cannot load pack-quantized files; "
          + _HUGE_PAGES),
    Patch(_W4A8, "CompressedTensorsW4A8Int8MoEMethod.process_weights_after_loading", "w4a8",
          "w4a8moe's packing for its layers, vLLM's for the others", _PROCESS),
    *(p for module, cls in ((_CT_WNA16, "CompressedTensorsWNA16MoEMethod"),
                            (_GPTQ, "AutoGPTQMoEMethod"), (_AWQ, "AutoAWQMoEMethod"))
      for p in (
          Patch(module, "select_wna16_moe_backend", "wna16",
                "w4a8moe's selection (the layer's GPTQ, AWQ or compressed-tensors scheme), "
                "then vLLM's", _SELECT),
          Patch(module, f"{cls}.__init__", "wna16",
                "vLLM's, with the scheme recorded for w4a8moe's layers", _WNA16_INIT),
          Patch(module, f"{cls}.create_weights", "wna16",
                "vLLM's, then float32 NaN scales and tracked zero-point loads for w4a8moe's "
                "layers", _WNA16_CREATE),
          Patch(module, f"{cls}.process_weights_after_loading", "wna16",
                "w4a8moe's packing for its layers, vLLM's for the others", _PROCESS))),
    Patch(_MXFP4, "select_mxfp4_moe_backend", "mxfp4",
          "w4a8moe's selection, then vLLM's", _SELECT),
    Patch(_MXFP4, "mxfp4_round_up_hidden_size_and_intermediate_size", "mxfp4",
          "the sizes unchanged for w4a8moe's backend, vLLM's rounding for the others",
          "vLLM pads H and I to 256 for its own kernels; w4a8moe takes any multiple of 32"),
    Patch(_MXFP4, "GptOssMxfp4MoEMethod.process_weights_after_loading", "mxfp4",
          "w4a8moe's packing for its layers, vLLM's for the others", _PROCESS),
    Patch("vllm.model_executor.kernels.linear", "_POSSIBLE_KERNELS", "dense",
          "w4a8moe's linear kernel inserted first in the CPU platform's list (edited in place)",
          "vLLM's CPU int4 linear kernel (cpu_gemm_wna16) is in its AVX-512 extension only, "
          "and slower than w4a8moe's without AMX; the kernel refuses per layer, with the "
          "reason, as W4A8MOE_VLLM_DENSE says"),
    *(Patch(module, f"{cls}.create_weights", "dense",
            "vLLM's, then float32 NaN scales for the layers w4a8moe's kernel took",
            _DENSE_CREATE)
      for module, cls in ((_GPTQ, "AutoGPTQLinearMethod"), (_AWQ, "AutoAWQMarlinLinearMethod"),
                          (_CT_DENSE, "CompressedTensorsWNA16"))),
    Patch(_UTILS, "dispatch_cpu_unquantized_gemm", "vocab",
          "the token embedding keeps its table alone (vLLM's GEMM on it prepared on its first "
          "call); the LM head's table is let go once vLLM's GEMM holds it; vLLM's dispatch for "
          "the other layers",
          "vLLM's CPU platform keeps a GEMM copy of every vocabulary table beside the table, "
          "0.6-1.2 GB each for 150-200k rows, which nothing reads"),
    Patch(_UTILS, "dispatch_cpu_unquantized_gemm", "dense_int8",
          "with W4A8MOE_VLLM_QUANTIZE_DENSE=int8, on top of vocab's: bfloat16 linear layers and "
          "the LM head quantized to int8 and run by w4a8moe's linear op (routers excepted); "
          "vocab's and vLLM's dispatch for the other layers",
          "the layers a quantized MoE checkpoint leaves in bfloat16 are about half of what a "
          "decode step reads; int8 halves them"),
)

# (module, attribute, by) -> (owner, name, vLLM's value, the plugin's value)
_applied: Dict[Tuple[str, str, str], tuple] = {}


def entry(module: str, attribute: str, by: str) -> Patch:
    """The ledger's entry, or RuntimeError when the ledger does not list the patch. `by`: the
    plugin module's name (its __name__ will do)."""
    by = by.rsplit(".", 1)[-1]
    for patch in LEDGER:
        if (patch.module, patch.attribute, patch.by) == (module, attribute, by):
            return patch
    raise RuntimeError(f"w4a8moe's vLLM plugin: {by} patches {module}.{attribute}, which "
                       f"vllm_plugin/patches.py's LEDGER does not list")


def _owner(module: str, attribute: str):
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def replace(module: str, attribute: str, by: str, make: Callable) -> None:
    """Sets vLLM's module.attribute to make(its value), once per process, after checking that
    the ledger lists it."""
    key = (module, attribute, entry(module, attribute, by).by)
    if key in _applied:
        return
    owner, name = _owner(module, attribute)
    original = getattr(owner, name)
    new = make(original)
    setattr(owner, name, new)
    _applied[key] = (owner, name, original, new)


def edit(module: str, attribute: str, by: str, change: Callable) -> None:
    """change(vLLM's module.attribute) edits that value in place (a table vLLM reads), once per
    process, after checking that the ledger lists it."""
    key = (module, attribute, entry(module, attribute, by).by)
    if key in _applied:
        return
    owner, name = _owner(module, attribute)
    value = getattr(owner, name)
    change(value)
    _applied[key] = (owner, name, value, value)


def applied() -> Tuple[Patch, ...]:
    """The ledger's entries this process has applied, in the order applied."""
    return tuple(entry(*key) for key in _applied)
