"""vLLM's dense int4 linear layers (GPTQ, AWQ and compressed-tensors W4A16 checkpoints: the
attention projections, shared experts, dense MLPs) through w4a8moe's linear op, where vLLM has no
kernel for them.

vLLM's CPU kernel for these layers (CPUWNA16LinearKernel, op cpu_gemm_wna16) is compiled into
its AVX-512 extension only: on x86 without AVX-512 vLLM loads its AVX2 extension, and a model
with int4 dense layers stops at its first forward. This module puts a kernel of its own first in
vLLM's list of CPU mixed-precision linear kernels (choose_mp_linear_kernel): it takes a layer
where vLLM's own kernel is missing or where it is slower (W4A8MOE_VLLM_DENSE=auto, the
default: every CPU but those with AMX, where vLLM's kernel was not measured against it; on AVX-512
without AMX w4a8moe's was faster at 1 to 2048 tokens, docs/whole-model.md), on every layer
(=on: the tests use it on any CPU), or never (=off). Like the MoE families it is a W4A8
computation of a W4A16 checkpoint: the weights exactly as the file holds them (int4 values, zero
points, float32 scales), each row of x quantized per row to int8.

Wrapped: the create_weights of AutoGPTQLinearMethod, AutoAWQMarlinLinearMethod and
CompressedTensorsWNA16, so that a layer w4a8moe takes loads its scales in float32 (exact) and
NaN until loaded (a scale the file lacks is an error naming the layer, not a silent value), and
its int4 words get huge pages before they load (memory.py).
"""

import os

import torch

from . import core, memory, patches

KIND = "W4A16 int4 linear"
COMPUTES = (", as W4A8: the checkpoint's int4 weights exactly, the activations quantized per "
            "token to int8")


def mode() -> str:
    value = os.environ.get("W4A8MOE_VLLM_DENSE", "auto").strip().lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"W4A8MOE_VLLM_DENSE: expected 'auto', 'on' or 'off', got '{value}'")
    return value


def vllm_has_dense_kernel() -> bool:
    """Whether vLLM's loaded C extension has its CPU int4 linear op (its AVX-512 build does, its
    AVX2 build does not)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's extension for this CPU)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def cpu_has_amx() -> bool:
    """Whether w4a8moe found AMX tiles on this CPU (its amx kernel set)."""
    import w4a8moe

    return "amx" in w4a8moe.available_kernel_sets()


def _make_kernel_class():
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.scalar_type import scalar_types

    class W4A8MoeLinearKernel(MPLinearKernel):
        """vLLM's mixed-precision linear kernel contract, run by torch.ops.w4a8moe.linear."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c):
            ok, reason = cls._can_implement(c)
            k, n = c.partition_weight_shape
            shape = f"K {k}, N {n}, group {c.group_size}"
            if ok:
                import w4a8moe

                core.say(f"w4a8moe: {KIND} ({shape}) runs through w4a8moe (kernel set "
                         f"{w4a8moe.active_kernel_set()}){COMPUTES}; not vLLM's CPUWNA16")
            elif mode() != "off":
                core.say(f"w4a8moe: {KIND} ({shape}) is left to vLLM ({reason})")
            return ok, reason

        @classmethod
        def _can_implement(cls, c):
            how = mode()
            if how == "off":
                return False, "W4A8MOE_VLLM_DENSE=off"
            if how == "auto" and vllm_has_dense_kernel() and cpu_has_amx():
                return False, ("vLLM's own CPU kernel cpu_gemm_wna16 is present and the CPU "
                               "has AMX; W4A8MOE_VLLM_DENSE=on gives these layers to w4a8moe")
            if c.weight_type not in (scalar_types.uint4b8, scalar_types.uint4):
                return False, f"weight type {c.weight_type} (w4a8moe: int4)"
            if c.zero_points != (c.weight_type == scalar_types.uint4):
                return False, f"weight type {c.weight_type} with zero points {c.zero_points}"
            if c.act_type not in (torch.float32, torch.bfloat16, torch.float16):
                return False, f"activations {c.act_type} (w4a8moe: float32, bfloat16, float16)"
            k, _ = c.partition_weight_shape
            if c.group_size != -1 and (c.group_size % 32 != 0 or k % c.group_size != 0):
                return False, (f"group size {c.group_size} (w4a8moe: -1 or a multiple of 32 "
                               f"dividing the {k} inputs)")
            return True, None

        def process_weights_after_loading(self, layer) -> None:
            _pack_layer(self, layer)

        def apply_weights(self, layer, x, bias=None):
            out = torch.ops.w4a8moe.linear(x, layer.w4a8moe_weight, layer.w4a8moe_rows)
            if core.tracing():
                core.trace(f"linear_forward {x.numel() // x.shape[-1]}")
            return out if bias is None else out + bias

    return W4A8MoeLinearKernel


_KERNEL = None


def kernel_class():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _make_kernel_class()
    return _KERNEL


def _pack_layer(kernel, layer) -> None:
    """vLLM's loaded tensors -> the library's checkpoint decoder (w4a8moe.pack_checkpoint_linear).
    GPTQ (and AWQ, which vLLM converts to GPTQ's order first, its zeros as they are) hold qweight
    [K/8, N] packed along the inputs, scales [G, N], qzeros [G, N/8] packed along the outputs;
    compressed-tensors weight_packed [N, K/8], weight_scale [N, G], weight_zero_point [N/8, G].
    The parameters' input_dim / output_dim say which."""
    import w4a8moe

    wq, ws, wz = kernel._get_weight_params(layer)
    prefix = getattr(layer, "prefix", None) or type(layer).__name__
    rows_first = getattr(wq, "input_dim", 0) == 1  # [N, K/8]: compressed-tensors' layout
    fmt = "compressed-tensors" if rows_first else "gptq_v2"
    scale = ws.data
    if (getattr(ws, "output_dim", 1) == 0) != rows_first:  # the scales the other way round
        scale = scale.t()
    by_row = scale if rows_first else scale.t()  # [N, G], a view
    missing = torch.isnan(by_row).any(1).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"{prefix}: {kernel.w_s_name} of output row(s) {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} not loaded: the checkpoint "
                         f"lacks them")
    zero = None
    if kernel.config.zero_points:
        zero = wz.data
        if (getattr(wz, "output_dim", 1) == 0) != rows_first:
            zero = zero.t()
    group = kernel.config.group_size
    packed = w4a8moe.pack_checkpoint_linear(fmt, wq.data, scale.float().contiguous(), group,
                                            zero_point=None if zero is None
                                            else zero.contiguous())
    info = w4a8moe.packed_info(packed)
    rows, cols = info.rows, info.cols
    from vllm.model_executor.utils import replace_parameter

    for name in (kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name):
        if name is not None and getattr(layer, name, None) is not None:  # freed, as vLLM frees
            replace_parameter(layer, name, torch.nn.Parameter(torch.empty(0),
                                                              requires_grad=False))
    layer.register_buffer("w4a8moe_weight", packed, persistent=False)
    layer.w4a8moe_rows = rows
    memory.release_freed()
    core.trace(f"linear {cols} {rows} {group} {w4a8moe.active_kernel_set()} "
               f"{info.weight_format}")


def _kernel_is_ours(method, *args, **kwargs) -> bool:
    """Whether the linear method's kernel (chosen in its create_weights) is w4a8moe's."""
    return isinstance(getattr(method, "kernel", None), kernel_class())


def _exact_scales(method, layer, *args, **kwargs) -> None:
    scale = getattr(layer, method.kernel.w_s_name)
    scale.data = torch.full(scale.shape, float("nan"), dtype=torch.float32)
    memory.huge_pages(layer)  # the int4 words, before they load


def _first_on_cpu(table) -> None:
    from vllm.platforms import PlatformEnum

    cpu = table.setdefault(PlatformEnum.CPU, [])
    if kernel_class() not in cpu:
        cpu.insert(0, kernel_class())


def install() -> None:
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.layers.quantization import auto_awq, auto_gptq
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16 as ct,
    )

    patches.edit(kernels.__name__, "_POSSIBLE_KERNELS", __name__, _first_on_cpu)
    for module, cls in ((auto_gptq, "AutoGPTQLinearMethod"),
                        (auto_awq, "AutoAWQMarlinLinearMethod"), (ct, "CompressedTensorsWNA16")):
        patches.replace(module.__name__, f"{cls}.create_weights", __name__,
                        lambda vllm: core.wrap(vllm, _exact_scales, _kernel_is_ours, after=True))
