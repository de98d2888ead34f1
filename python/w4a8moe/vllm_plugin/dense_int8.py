"""vLLM's bfloat16 dense layers (attention projections, shared experts, dense MLPs, the LM head)
quantized at load to int8 per output channel and run through w4a8moe's linear op, when
W4A8MOE_VLLM_QUANTIZE_DENSE=int8 (default off).

Why: at decode a step reads every weight once, and in a quantized MoE checkpoint the layers left
in bfloat16 are about half of those bytes (gpt-oss-20b: its attention as much as its active
MXFP4 experts, and an LM head of 1.16 GB). int8 halves them, with the accuracy class of GGUF's
Q8_0 (what llama.cpp users run): symmetric per output row, scale = max|w| / 127. The layer then
runs as the library's int4 layers do, each row of x quantized per row to int8 (W8A8), at one
byte per weight (docs/operator.md, "Dense linear layers").

The token embedding is left a plain table: vLLM would prepare a GEMM on it as well (a oneDNN
copy of the table) that only models whose logits come from the embedding itself use; here that
GEMM, in int8, is packed on its first call instead.

Where: vLLM's CPU platform prepares every unquantized linear layer and the LM head in
vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm (it sets layer.cpu_linear, which
the layer's forward calls, in eager mode and in the compiled graph alike). This module wraps that
function: a layer it takes gets w4a8moe's packed int8 weights and a cpu_linear that calls
torch.ops.w4a8moe.linear; every other layer goes to vLLM's dispatch unchanged. Taken: 2-D
float weights whose input width is a multiple of 32, in vLLM's linear layers and its LM head
(ParallelLMHead; a tied LM head too: its own reference to the weight is dropped, the embedding's
stays). Left to vLLM, said in the log: the MoE routers (layers named gate, router,
shared_expert_gate: routing stays in the model's dtype, so that int8 noise does not change which
experts a token gets), layers whose input width is not a multiple of 32, and an LM head whose
logits the model computes in another dtype (vLLM's head_dtype; vLLM reads its table itself).
"""

import os

import torch

from . import core, memory, patches, vocab

KIND = "bfloat16 dense layer"
#: last components of a layer's name that are MoE routers (kept in the model's dtype)
ROUTERS = ("gate", "router", "shared_expert_gate")


def mode() -> str:
    value = os.environ.get("W4A8MOE_VLLM_QUANTIZE_DENSE", "off").strip().lower()
    if value not in ("off", "int8"):
        raise ValueError(f"W4A8MOE_VLLM_QUANTIZE_DENSE: expected 'off' or 'int8', got "
                         f"'{value}'")
    return value


def _refusal(layer):
    """None when w4a8moe takes the layer, else why not."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    name = getattr(layer, "prefix", "") or ""
    if not isinstance(layer, (LinearBase, ParallelLMHead)):
        return f"{type(layer).__name__} is not a linear layer or the LM head"
    if name.rsplit(".", 1)[-1] in ROUTERS:
        return "a MoE router (routing stays in the model's dtype)"
    weight = getattr(layer, "weight", None)
    if weight is None or weight.is_meta or weight.dim() != 2:
        return "no 2-D weight"
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {weight.dtype}"
    if weight.shape[1] % 32 != 0:
        return f"{weight.shape[1]} inputs (w4a8moe's int8 layers: a multiple of 32)"
    if isinstance(layer, ParallelLMHead) and vocab.head_dtype_differs(layer):
        return "the model computes its logits in another dtype (vLLM's head_dtype)"
    return None


def _describe(layer) -> str:
    """The layer's shape, and its kind when it is the LM head (one log line per shape)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    n, k = layer.weight.shape
    return ("LM head, " if isinstance(layer, ParallelLMHead) else "") + f"K {k}, N {n}"


def _quantize(layer) -> None:
    """Quantizes and packs the layer's weight, frees the layer's reference to it, and sets
    layer.cpu_linear to w4a8moe's op."""
    import w4a8moe

    weight = layer.weight.data
    rows, cols = weight.shape
    dtype = weight.dtype
    values, scales = w4a8moe.quantize_linear_int8(weight)
    # the layer's reference goes before the packing (vLLM's own dispatch drops it too, with
    # remove_weight), so that the float table, its int8 values and the packed buffer are never
    # held at once: an LM head of 200k rows would hold 2.3 GB instead of 1.7. A tied embedding
    # keeps its own.
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    del weight
    packed = w4a8moe.pack_linear_int8(values, scales)
    del values, scales
    layer.register_buffer("w4a8moe_int8_weight", packed, persistent=False)
    layer.w4a8moe_rows = rows
    memory.release_freed()

    def cpu_linear(x, _weight, bias, layer=layer):
        out = torch.ops.w4a8moe.linear(x, layer.w4a8moe_int8_weight, layer.w4a8moe_rows)
        if core.tracing():
            core.trace(f"int8_forward {x.numel() // x.shape[-1]}")
        return out if bias is None else out + bias

    layer.cpu_linear = cpu_linear
    core.trace(f"int8 {cols} {rows} {w4a8moe.active_kernel_set()} "
               f"{getattr(layer, 'prefix', '') or type(layer).__name__}")


def _lazy_embedding(layer) -> None:
    """A token embedding: vLLM prepares a GEMM on its table too (a oneDNN copy of it, 0.6-1.2 GB
    for the vocabularies of 150-200k rows), which only models that compute their logits with the
    embedding itself use (Gemma, Command R). Here the table stays the lookup's alone, and its
    int8 GEMM is packed on the first call, if one comes."""

    def cpu_linear(x, weight, bias, layer=layer):
        if getattr(layer, "w4a8moe_int8_weight", None) is None:
            import w4a8moe

            values, scales = w4a8moe.quantize_linear_int8(layer.weight.data)
            layer.w4a8moe_int8_weight = w4a8moe.pack_linear_int8(values, scales)
            layer.w4a8moe_rows = values.shape[0]
        out = torch.ops.w4a8moe.linear(x, layer.w4a8moe_int8_weight, layer.w4a8moe_rows)
        return out if bias is None else out + bias

    layer.w4a8moe_int8_weight = None
    layer.cpu_linear = cpu_linear


def _int8(layer, remove_weight) -> None:
    """A layer w4a8moe takes: quantized and packed, or (the token embedding) made lazy."""
    if vocab.kind_of(layer) == "embedding":  # (never a layer _refusal lets through)
        _lazy_embedding(layer)
        return None
    import w4a8moe

    what = _describe(layer)
    _quantize(layer)
    core.say(f"w4a8moe: {KIND} ({what}) quantized to int8 per output channel runs through "
             f"w4a8moe (kernel set {w4a8moe.active_kernel_set()}), the activations quantized "
             f"per token to int8; not vLLM's bfloat16 GEMM")
    return None


def _takes(layer, remove_weight) -> bool:
    """Whether w4a8moe takes the layer (the log says why not)."""
    reason = _refusal(layer)
    if reason is None:
        return True
    if vocab.kind_of(layer) == "embedding" and layer.weight.shape[1] % 32 == 0:
        return True
    name = (getattr(layer, "prefix", "") or type(layer).__name__).split(".")[-1]
    core.say(f"w4a8moe: {KIND} '{name}' stays vLLM's ({reason})")
    return False


def install() -> None:
    patches.replace("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", __name__,
                    lambda vllm: core.wrap(vllm, _int8, _takes))
