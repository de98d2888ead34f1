"""vLLM plugin: the engine's int4 and MXFP4 MoE layers run through w4a8moe on every CPU.

Installed with the package, it is a `vllm.general_plugins` entry point (pyproject.toml), which
vLLM loads in each of its processes (front end, engine core, workers) before it builds a model.
It changes none of vLLM's files. On vLLM's CPU platform it hooks in where vLLM chooses the
experts kernel of a MoE layer (each symbol it patches listed, with why, in patches.py), one
module per vLLM method family, around a shared core:

  w4a8   compressed-tensors W4A8 (int4 weights, dynamic per-token int8 activations)
  wna16  compressed-tensors W4A16, GPTQ and AWQ int4 (computed as W4A8: the weights exactly,
         the activations quantized per token to int8)
  mxfp4  gpt-oss MXFP4 (likewise)
  dense  the dense int4 linear layers of GPTQ, AWQ and W4A16 checkpoints (attention, shared
         experts), where vLLM has no kernel for them: x86 without AVX-512 (likewise)
  dense_int8  on request (W4A8MOE_VLLM_QUANTIZE_DENSE=int8), the bfloat16 dense layers and the
         LM head quantized at load to int8 per output channel (W8A8; routers stay bfloat16)
  vocab  the token embedding and the LM head held once each in memory (vLLM's CPU platform
         otherwise keeps a GEMM copy of each beside its table)

For each layer: its configuration is offered to w4a8moe first; when w4a8moe takes it, vLLM's
log says so, and when w4a8moe refuses, the log gives the reason and vLLM's own selection runs
as it would without the plugin. The weights are packed once, exactly as the checkpoint holds
them, and vLLM's unpacked tensors are freed; the forward pass routes inside
torch.ops.w4a8moe.moe_routed (softmax or sigmoid scores, correction bias, grouped top-k), or runs
vLLM's CPU router and then torch.ops.w4a8moe.dynamic_4bit_int_moe_ex where the op cannot route
(custom routing functions, expert parallelism). docs/vllm.md tells a vLLM user how to install and
serve, and what each family takes.

Settings (environment variables, read in each vLLM process):
  W4A8MOE_VLLM          "auto" (default): as above; "off": the plugin does nothing.
  W4A8MOE_VLLM_FORMATS  "all" (default) or a comma list of w4a8, wna16, mxfp4: the families
                        w4a8moe takes; the others are left to vLLM.
  W4A8MOE_VLLM_DENSE    "auto" (default): the dense int4 layers where vLLM's own CPU kernel is
                        missing; "on": every dense int4 layer; "off": none.
  W4A8MOE_VLLM_QUANTIZE_DENSE  "off" (default) or "int8": the bfloat16 dense layers and the LM
                        head through w4a8moe in int8 (module dense_int8).
  W4A8MOE_VLLM_TRACE    a file path: each process appends one line per layer packed
                        ("pack <H> <I> <E> <group> <activation> <kernel set> <weight format>
                        <packed bytes> tp<rank>/<size> ep<rank>/<size>", I and E this rank's)
                        and per forward call ("forward <tokens> <1 if the router weight is on
                        the input>", then "local" under expert parallelism); off when unset
                        (no cost). Under torch.compile only eager calls write a forward line.

Supported vLLM versions: SUPPORTED_VLLM (also the `vllm` extra of the package). Another version
is refused when the plugin loads, with the versions it supports, because the plugin relies on
the names of vLLM's internal modules; W4A8MOE_VLLM=off lets that vLLM run without it.
"""

import os
import threading

from .core import SUPPORTED_VLLM, check_vllm_version

__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "register"]

_installed = False
_install_lock = threading.Lock()


def register() -> None:
    """The entry point vLLM calls in each process (vllm.general_plugins)."""
    from . import core

    mode = os.environ.get("W4A8MOE_VLLM", "auto").lower()
    if mode == "off":
        return
    if mode != "auto":
        raise ValueError(f"W4A8MOE_VLLM: expected 'auto' or 'off', got '{mode}'")
    wanted = core.families()
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        core.logger().debug("w4a8moe: not vLLM's CPU platform; the plugin stays inactive")
        return
    _install(wanted)


def _install(wanted) -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        from . import dense, dense_int8, mxfp4, vocab, w4a8, wna16

        vocab.install()  # under dense_int8's wrapper of the same function
        for name, module in (("w4a8", w4a8), ("wna16", wna16), ("mxfp4", mxfp4)):
            if name in wanted:
                module.install()
        if dense.mode() != "off":
            dense.install()
        if dense_int8.mode() != "off":
            dense_int8.install()
        _installed = True
