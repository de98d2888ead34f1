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

import sys
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
# layers' process_weights_after_loading repacks them for its GPU kernels), packed exactly.
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

_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of AWQ's words holding output 8w + j


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """[..., R/8, C] int32 -> [..., R, C] unsigned 4-bit values (row 8w + i in bits 4i)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    q = (words.unsqueeze(-2) >> shifts.view(-1, 1)) & 15
    return q.reshape(*words.shape[:-2], words.shape[-2] * 8, words.shape[-1])


def nibbles_of(words: torch.Tensor) -> torch.Tensor:
    """[..., R, C/8] int32 words holding column 8w + j in bits 4j, each as value + 8 (GPTQ's
    qweight transposed, compressed-tensors' weight_packed) -> [..., R, C/2] uint8: the same
    bytes, which are w4a8moe's nibble-packed layout (element 2j in the low nibble, value + 8;
    docs/operator.md) on a little-endian CPU. No copy when `words` is contiguous: packing from
    it takes no unpacked int8 (let alone int32) copy of the layer, whose transients would
    otherwise be several times the layer (8 int32 per word)."""
    if sys.byteorder != "little":
        raise RuntimeError("w4a8moe.vllm.nibbles_of: a little-endian CPU is expected")
    return words.contiguous().view(torch.uint8)


def _unpack_cols(words: torch.Tensor, awq: bool) -> torch.Tensor:
    """[..., R, C/8] int32 -> [..., R, C] unsigned 4-bit values, column 8w + j in bits 4j (GPTQ)
    or 4 * _AWQ_NIBBLE[j] (AWQ)."""
    nibbles = _AWQ_NIBBLE if awq else tuple(range(8))
    shifts = torch.tensor([4 * n for n in nibbles], dtype=torch.int32, device=words.device)
    q = (words.unsqueeze(-1) >> shifts) & 15
    return q.reshape(*words.shape[:-1], words.shape[-1] * 8)


def _check(name, t, dtype, shape):
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
        got = (f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name}: expected {dtype} {list(shape)}, got {got}")


def _group_order(g_idx: torch.Tensor, group_size: int, name: str) -> Optional[torch.Tensor]:
    """[E, K] groups -> the inputs sorted by group, stably, [E, K] int32 (None: already k / g).
    Each group must hold group_size inputs."""
    experts, cols = g_idx.shape
    g = cols if group_size == -1 else group_size
    natural = (torch.arange(cols, device=g_idx.device) // g).expand(experts, cols)
    if torch.equal(g_idx.long(), natural):
        return None
    counts = torch.stack([torch.bincount(g_idx[e].long(), minlength=cols // g)
                          for e in range(experts)])
    if counts.shape[1] != cols // g or not bool((counts == g).all()):
        raise ValueError(f"{name}: expected {g} inputs in each of the {cols // g} groups "
                         f"(act-order), got counts {counts.tolist()}")
    return torch.argsort(g_idx.long(), dim=1, stable=True).to(torch.int32)


def _pack_zero_point_layer(q13, q2, z13, z2, s13, s2, group_size, g13_idx, g2_idx,
                           kernel_set, symmetric, w13_bias=None, w2_bias=None,
                           gate_up_layout="halves"):
    """Unsigned values q [E, N, K] (int32), or their nibbles uint8 [E, N, K/2] (nibbles_of; no
    act-order then), and zeros z [E, N, G] (None: 8) -> w4a8moe.pack, act-order g_idx turned
    into w13's input order (w2's into w13's row order). Biases as float32."""
    from . import pack  # the package's packing entry

    nibbles = q13.dtype == torch.uint8
    if nibbles and (g13_idx is not None or g2_idx is not None):
        raise ValueError("act-order g_idx needs the unpacked values, got nibble-packed weights")

    order13 = None if g13_idx is None else _group_order(g13_idx, group_size, "w13_g_idx")
    order2 = None if g2_idx is None else _group_order(g2_idx, group_size, "w2_g_idx")
    if order13 is not None:  # columns in group order; w13's input order says where they came from
        q13 = torch.gather(q13, 2, order13.long().unsqueeze(1).expand_as(q13))
    if order2 is not None and gate_up_layout != "halves":
        raise ValueError("w2_g_idx: act-order of down's inputs needs w13's gate and up in "
                         f"halves, got gate_up_layout '{gate_up_layout}'")
    if order2 is not None:  # down's inputs are w13's rows (gate, up): move them together
        q2 = torch.gather(q2, 2, order2.long().unsqueeze(1).expand_as(q2))
        inter = q13.shape[1] // 2
        rows = torch.cat([order2.long(), order2.long() + inter], dim=1)
        q13 = torch.gather(q13, 1, rows.unsqueeze(2).expand_as(q13))
        s13 = torch.gather(s13, 1, rows.unsqueeze(2).expand_as(s13))
        if z13 is not None:
            z13 = torch.gather(z13, 1, rows.unsqueeze(2).expand_as(z13))
        if w13_bias is not None:
            w13_bias = torch.gather(w13_bias, 1, rows)
    w13 = q13 if nibbles else (q13 - 8).to(torch.int8)
    w2 = q2 if nibbles else (q2 - 8).to(torch.int8)
    zero13 = None if symmetric else (z13 - 8).to(torch.int8).contiguous()
    zero2 = None if symmetric else (z2 - 8).to(torch.int8).contiguous()
    if group_size == -1:
        s13, s2 = s13[..., 0], s2[..., 0]
        zero13 = None if zero13 is None else zero13[..., 0].contiguous()
        zero2 = None if zero2 is None else zero2[..., 0].contiguous()
    return pack(w13.contiguous(), w2.contiguous(), s13.contiguous(), s2.contiguous(), group_size,
                None if w13_bias is None else w13_bias.to(torch.float32).contiguous(),
                None if w2_bias is None else w2_bias.to(torch.float32).contiguous(),
                gate_up_layout=gate_up_layout, kernel_set=kernel_set, w13_zero_point=zero13,
                w2_zero_point=zero2,
                w13_input_order=None if order13 is None else order13.contiguous())


def pack_gptq_moe(w13_qweight, w2_qweight, w13_scales, w2_scales, group_size, *, w13_qzeros=None,
                  w2_qzeros=None, w13_g_idx=None, w2_g_idx=None, sym=True,
                  zeros_minus_one=True, kernel_set="", w13_bias=None, w2_bias=None,
                  gate_up_layout="halves"):
    """The engine's GPTQ MoE tensors (layout above) -> (w13_packed, w2_packed), exactly: int4
    symmetric for sym, else int4 with zero points; act-order g_idx as w13's input order (docs/
    operator.md, "Input order"). zeros_minus_one: the "gptq" checkpoint format (False:
    "gptq_v2"). Biases [E, 2I] / [E, H] and gate_up_layout as w4a8moe.pack takes them."""
    experts, packed_h, two_i = w13_qweight.shape
    hidden, inter = packed_h * 8, two_i // 2
    groups13 = 1 if group_size == -1 else hidden // group_size
    groups2 = 1 if group_size == -1 else inter // group_size
    _check("w13_qweight", w13_qweight, torch.int32, (experts, hidden // 8, 2 * inter))
    _check("w2_qweight", w2_qweight, torch.int32, (experts, inter // 8, hidden))
    if w13_scales.shape != (experts, groups13, 2 * inter) or w2_scales.shape != (
            experts, groups2, hidden):
        raise ValueError(f"w13_scales, w2_scales: expected [{experts}, {groups13}, {2 * inter}] "
                         f"and [{experts}, {groups2}, {hidden}], got {list(w13_scales.shape)} "
                         f"and {list(w2_scales.shape)}")
    z13 = z2 = None
    if not sym:
        for name, z, g, n in (("w13_qzeros", w13_qzeros, groups13, 2 * inter),
                              ("w2_qzeros", w2_qzeros, groups2, hidden)):
            _check(name, z, torch.int32, (experts, g, n // 8))
        add = 1 if zeros_minus_one else 0
        z13 = (_unpack_cols(w13_qzeros, False) + add).transpose(1, 2)  # [E, 2I, G]
        z2 = (_unpack_cols(w2_qzeros, False) + add).transpose(1, 2)
        if bool((z13 > 15).any()) or bool((z2 > 15).any()):
            raise ValueError("qzeros: a stored 15 is a zero of 16 in the \"gptq\" format, "
                             "outside [0, 15]")
    for name, g, n in (("w13_g_idx", w13_g_idx, hidden), ("w2_g_idx", w2_g_idx, inter)):
        if g is not None and g.numel() > 0:
            _check(name, g, g.dtype, (experts, n))
    g13 = w13_g_idx if w13_g_idx is not None and w13_g_idx.numel() > 0 else None
    g2 = w2_g_idx if w2_g_idx is not None and w2_g_idx.numel() > 0 else None
    if g13 is None and g2 is None:  # the words along the inputs are w4a8moe's nibbles
        q13 = nibbles_of(w13_qweight.transpose(1, 2))  # [E, 2I, H/2]
        q2 = nibbles_of(w2_qweight.transpose(1, 2))    # [E, H, I/2]
    else:  # act-order gathers single inputs
        q13 = _unpack_rows(w13_qweight).transpose(1, 2)  # [E, 2I, H]
        q2 = _unpack_rows(w2_qweight).transpose(1, 2)    # [E, H, I]
    return _pack_zero_point_layer(q13, q2, z13, z2, w13_scales.transpose(1, 2),
                                  w2_scales.transpose(1, 2), group_size, g13, g2, kernel_set, sym,
                                  w13_bias, w2_bias, gate_up_layout)


def pack_awq_moe(w13_qweight, w2_qweight, w13_scales, w2_scales, w13_qzeros, w2_qzeros,
                 group_size, *, kernel_set="", w13_bias=None, w2_bias=None,
                 gate_up_layout="halves"):
    """The engine's AWQ MoE tensors (layout above) -> (w13_packed, w2_packed), exactly, as int4
    with zero points. Biases and gate_up_layout as pack_gptq_moe."""
    experts, hidden, packed_two_i = w13_qweight.shape
    inter = packed_two_i * 8 // 2
    groups13 = 1 if group_size == -1 else hidden // group_size
    groups2 = 1 if group_size == -1 else inter // group_size
    _check("w13_qweight", w13_qweight, torch.int32, (experts, hidden, 2 * inter // 8))
    _check("w2_qweight", w2_qweight, torch.int32, (experts, inter, hidden // 8))
    _check("w13_qzeros", w13_qzeros, torch.int32, (experts, groups13, 2 * inter // 8))
    _check("w2_qzeros", w2_qzeros, torch.int32, (experts, groups2, hidden // 8))
    q13 = _unpack_cols(w13_qweight, True).transpose(1, 2)  # [E, 2I, H]
    q2 = _unpack_cols(w2_qweight, True).transpose(1, 2)
    z13 = _unpack_cols(w13_qzeros, True).transpose(1, 2)  # [E, 2I, G]
    z2 = _unpack_cols(w2_qzeros, True).transpose(1, 2)
    return _pack_zero_point_layer(q13, q2, z13, z2, w13_scales.transpose(1, 2),
                                  w2_scales.transpose(1, 2), group_size, None, None, kernel_set,
                                  False, w13_bias, w2_bias, gate_up_layout)


def pack_mxfp4_moe(w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, w13_bias=None,
                   w2_bias=None, *, kernel_set=""):
    """The engine's MXFP4 MoE tensors (gpt-oss; layout above) -> (w13_packed, w2_packed),
    exactly: the codes and e8m0 exponents as they are, gate and up interleaved."""
    from . import pack

    return pack(w13_weight, w2_weight, w13_weight_scale, w2_weight_scale, 32,
                None if w13_bias is None else w13_bias.to(torch.float32),
                None if w2_bias is None else w2_bias.to(torch.float32),
                gate_up_layout="interleaved", kernel_set=kernel_set)
