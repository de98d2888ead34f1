"""Drop-in replacements for the serving engine's dynamic 4-bit int MoE CPU path.

The engine (vLLM) packs a layer's experts once with

    w13_packed, w2_packed, *_ = convert_to_w4a8_int8_moe_format(
        w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, group_size,
        w13_bias=..., w2_bias=...)

(from vllm.model_executor.layers.fused_moe.oracle.w4a8_int8), and runs it with

    torch.ops._C.dynamic_4bit_int_moe(x, topk_ids, topk_weights, w13_packed, w2_packed,
                                      hidden_size, intermediate_size, group_size,
                                      apply_router_weight_on_input, activation_kind)

where activation_kind comes from CPUExpertsInt4._activation_kind(activation). This module has
the same three calls with the same arguments and return values, so switching is an import:

    from w4a8moe.vllm import (convert_to_w4a8_int8_moe_format, dynamic_4bit_int_moe,
                              activation_kind)

Arguments, one by one (E experts, I intermediate size, H hidden size, g group size):

convert_to_w4a8_int8_moe_format
  w13_weight        [E, 2I, H] int8, int4 values in [-8, 7]; rows [0, I) gate, [I, 2I) up
  w2_weight         [E, H, I] int8, int4 values in [-8, 7]
  w13_weight_scale  [E, 2I, H/g], or [E, 2I, 1] when group_size is -1
  w2_weight_scale   [E, H, I/g], or [E, H, 1] when group_size is -1
  group_size        -1 (one scale per output row) or g: a multiple of 32 dividing H and I
                    (the engine's own kernels take 32, 64 and 128, this library any such g)
  w13_bias          optional [E, 2I]
  w2_bias           optional [E, H]
  returns six values as the engine's: (w13_packed, w2_packed, and four empty tensors that the
  engine puts in place of the raw weights it frees). The packed tensors are this library's
  self-describing buffers (1-D uint8), not the engine's [E, bytes] KleidiAI blocks: only
  dynamic_4bit_int_moe below reads them. Like the engine, scales are rounded to bfloat16 for
  group-wise packing and kept in float32 for channel-wise, and biases become float32, so that
  results match the engine's numerics; w4a8moe.pack keeps scales exactly as given instead.

dynamic_4bit_int_moe
  x                 [T, H] float32, bfloat16 or float16 (rows may be strided)
  topk_ids          [T, K] int64 (the engine passes .to(torch.long)) or int32, in [0, E)
  topk_weights      [T, K] float32, bfloat16 or float16, used as given
  w13_packed, w2_packed   from convert_to_w4a8_int8_moe_format
  hidden_size       H (the engine's w2_out_features)
  intermediate_size I (the engine's w2_in_features)
  group_size        as packed
  apply_router_weight_on_input   scale x by the router weight before the experts (top-1
                    models such as Llama-4) instead of the experts' outputs
  activation_kind   0 swiglustep, 1 swigluoai, 2 silu (the engine's codes), 3 gelu, 4 gelu_tanh
  returns           [T, H] in x's dtype
  An older form of the engine's op took 2I as an eighth argument (hidden_size,
  intermediate_size, 2 * intermediate_size, group_size, ...); that form is accepted too, with
  the 2I checked.

pack_gptq_moe, pack_awq_moe, pack_mxfp4_moe
  The engine's GPTQ, AWQ and MXFP4 MoE layers' tensors as its loaders leave them (the layouts
  at their definitions below) -> (w13_packed, w2_packed) for dynamic_4bit_int_moe, exactly:
  zero points, GPTQ's act-order (w13's input order) and MXFP4's codes kept, not requantized.

activation_kind(activation)
  The engine's MoEActivation (or its value, a string: "silu", "swigluoai", "swiglustep",
  and "gelu", "gelu_tanh", which the engine's path rejects and this library runs) -> the
  integer code above. Anything else is a ValueError, as in the engine.
"""

from typing import Optional, Tuple

import torch

from . import ops
from ._activations import NAMES, activation_code

__all__ = ["activation_kind", "convert_to_w4a8_int8_moe_format", "dynamic_4bit_int_moe",
           "pack_awq_moe", "pack_gptq_moe", "pack_mxfp4_moe"]


def activation_kind(activation) -> int:
    """The engine's MoEActivation (or its string value) -> the op's integer code."""
    value = getattr(activation, "value", activation)
    if isinstance(value, str):
        return activation_code(value)
    raise ValueError(f"activation: expected one of {', '.join(NAMES)}, got '{value}'")


def convert_to_w4a8_int8_moe_format(
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor,
    w2_weight_scale: torch.Tensor,
    group_size: int,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
           Optional[torch.Tensor]]:
    """Packs a layer's experts; returns (w13_packed, w2_packed, empty, empty, empty, empty)."""
    for name, t in (("w13_weight", w13_weight), ("w2_weight", w2_weight)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected an int8 tensor of int4 values in [-8, 7], "
                            f"got {got}")
    scale_dtype = torch.float32 if group_size == -1 else torch.bfloat16
    w13_packed, w2_packed = ops.convert_to_w4a8_int8_moe_format(
        w13_weight, w2_weight, w13_weight_scale.to(scale_dtype), w2_weight_scale.to(scale_dtype),
        group_size,
        None if w13_bias is None else w13_bias.to(torch.float32),
        None if w2_bias is None else w2_bias.to(torch.float32),
    )
    empty = torch.empty(0)
    return w13_packed, w2_packed, empty, empty, empty, empty


def dynamic_4bit_int_moe(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden_size,
                         intermediate_size, group_size, apply_router_weight_on_input,
                         activation_kind, *older_form):
    """The MoE layer, with the engine's op's arguments; out [T, H] in x's dtype."""
    if older_form:
        # (H, I, 2I, group_size, apply_router_weight_on_input, activation_kind)
        if len(older_form) != 1:
            raise TypeError(f"dynamic_4bit_int_moe: expected 10 arguments (or 11 with 2I), got "
                            f"{10 + len(older_form)}")
        two_i = group_size
        if two_i != 2 * intermediate_size:
            raise ValueError(f"I2: expected 2 * intermediate_size = {2 * intermediate_size}, "
                             f"got {two_i}")
        group_size, apply_router_weight_on_input, activation_kind = (
            apply_router_weight_on_input, activation_kind, older_form[0])
    return ops.dynamic_4bit_int_moe(x, topk_ids, topk_weights, w13_packed, w2_packed,
                                    hidden_size, intermediate_size, group_size,
                                    bool(apply_router_weight_on_input), int(activation_kind))


# ---------------------------------------------------------------------------------------------
# The engine's quantized MoE layers' tensors, as its weight loaders leave them (before the
# layers' process_weights_after_loading repacks them for its GPU kernels), packed exactly by the
# library's checkpoint decoder (w4a8moe.checkpoint; its errors name the tensor as
# "w13.weight", "w2.zero_point", ...).
#
# GPTQ (GPTQMarlinMoEMethod.create_weights; E experts, H hidden, I intermediate, g group size,
# G = H/g or I/g groups, 1 when g is -1):
#   w13_qweight [E, H/8, 2I] int32   eight inputs a word: input k of output n in bits 4 (k % 8)
#   w2_qweight  [E, I/8, H]  int32   of word [k / 8, n], the unsigned value q
#   w13_scales  [E, G, 2I], w2_scales [E, G, H]
#   w13_qzeros  [E, G, 2I/8], w2_qzeros [E, G, H/8] int32: eight outputs a word, zero of output
#                                    n in bits 4 (n % 8); GPTQ's "gptq" format stores zero - 1
#   w13_g_idx [E, H], w2_g_idx [E, I]   act-order (desc_act): input k's group
#   element (k, n) = (q - zero) * scale of group g_idx[k]; sym: zero 8.
# AWQ (AWQMarlinMoEMethod.create_weights): w13_qweight [E, H, 2I/8] and w2_qweight [E, I, H/8]
#   pack eight outputs a word in AWQ's order (output 8w + j in bits 4 * [0, 4, 1, 5, 2, 6, 3, 7][j]),
#   qzeros likewise, zeros as is; scales [E, G, N].
# MXFP4 (gpt-oss): w13_weight [E, 2I, H/2] and w2_weight [E, H, I/2] uint8 e2m1 codes,
#   *_weight_scale [E, N, K/32] uint8 e8m0, biases [E, 2I] / [E, H]; gate and up interleaved.


def pack_gptq_moe(w13_qweight, w2_qweight, w13_scales, w2_scales, group_size, *, w13_qzeros=None,
                  w2_qzeros=None, w13_g_idx=None, w2_g_idx=None, sym=True,
                  zeros_minus_one=True, kernel_set="", w13_bias=None, w2_bias=None,
                  gate_up_layout="halves"):
    """The engine's GPTQ MoE tensors (layout above) -> (w13_packed, w2_packed), exactly: int4
    symmetric for sym (the qzeros are not read), else int4 with zero points; act-order g_idx as
    w13's input order (docs/operator.md, "Input order"). zeros_minus_one: the "gptq" checkpoint
    format (False: "gptq_v2"). Biases [E, 2I] / [E, H] and gate_up_layout as w4a8moe.pack takes
    them."""
    from .checkpoint import pack_checkpoint_moe

    if not sym and (w13_qzeros is None or w2_qzeros is None):
        raise ValueError("w13_qzeros, w2_qzeros: expected the zero points of an asymmetric "
                         "(sym=False) layer, got none")
    return pack_checkpoint_moe(
        "gptq" if zeros_minus_one else "gptq_v2", w13_qweight, w13_scales, w2_qweight, w2_scales,
        group_size, w13_zero_point=None if sym else w13_qzeros,
        w2_zero_point=None if sym else w2_qzeros, w13_g_idx=w13_g_idx, w2_g_idx=w2_g_idx,
        w13_bias=_float32(w13_bias), w2_bias=_float32(w2_bias), gate_up_layout=gate_up_layout,
        kernel_set=kernel_set)


def pack_awq_moe(w13_qweight, w2_qweight, w13_scales, w2_scales, w13_qzeros, w2_qzeros,
                 group_size, *, kernel_set="", w13_bias=None, w2_bias=None,
                 gate_up_layout="halves"):
    """The engine's AWQ MoE tensors (layout above) -> (w13_packed, w2_packed), exactly, as int4
    with zero points. Biases and gate_up_layout as pack_gptq_moe."""
    from .checkpoint import pack_checkpoint_moe

    return pack_checkpoint_moe(
        "awq", w13_qweight, w13_scales, w2_qweight, w2_scales, group_size,
        w13_zero_point=w13_qzeros, w2_zero_point=w2_qzeros, w13_bias=_float32(w13_bias),
        w2_bias=_float32(w2_bias), gate_up_layout=gate_up_layout, kernel_set=kernel_set)


def pack_mxfp4_moe(w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, w13_bias=None,
                   w2_bias=None, *, kernel_set=""):
    """The engine's MXFP4 MoE tensors (gpt-oss; layout above) -> (w13_packed, w2_packed),
    exactly: the codes and e8m0 exponents as they are, gate and up interleaved."""
    from .checkpoint import pack_checkpoint_moe

    return pack_checkpoint_moe(
        "mxfp4", w13_weight, w13_weight_scale, w2_weight, w2_weight_scale, 32,
        w13_bias=_float32(w13_bias), w2_bias=_float32(w2_bias), gate_up_layout="interleaved",
        kernel_set=kernel_set)


def _float32(bias):
    """Biases are kept in float32, as the engine's layers do."""
    return None if bias is None else bias.to(torch.float32)
