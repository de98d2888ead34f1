"""w4a8moe for PyTorch: the Mixture-of-Experts layer of LLMs on CPUs, with int4 weights and
dynamic int8 activations, as torch ops.

    import w4a8moe
    w13_packed, w2_packed = w4a8moe.pack(w13, w2, w13_scale, w2_scale, group_size=128)
    out = w4a8moe.moe(x, topk_ids, topk_weights, w13_packed, w2_packed, activation="silu")

Importing the package registers the ops under torch.ops.w4a8moe; the raw op
torch.ops.w4a8moe.dynamic_4bit_int_moe has the schema and meaning of vLLM's CPU operator
torch.ops._C.dynamic_4bit_int_moe.
Every op also has a Meta kernel (shapes and dtypes only), so it runs on meta tensors and under
FakeTensorMode. Library errors are raised as RuntimeError with the library's message. Expert
parallelism over torch.distributed: w4a8moe.distributed.
"""

import os
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from ._activations import Activation, activation_code
from .reference import activate, dequantize_weights, quant_row, reference_moe

__all__ = [
    "Activation",
    "PackedInfo",
    "activation_code",
    "active_kernel_set",
    "available_kernel_sets",
    "cpu_features",
    "dequantize_weights",
    "get_num_threads",
    "is_supported_config",
    "linear",
    "moe",
    "moe_routed",
    "pack_checkpoint_linear",
    "pack_checkpoint_moe",
    "ops",
    "pack",
    "pack_linear",
    "pack_linear_int8",
    "pack_with_original_op",
    "packed_info",
    "quantize_linear_int8",
    "quant_row",
    "reference_moe",
    "set_isa_cap",
    "set_num_threads",
    "activate",
]

_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_w4a8moe_torch.so")
torch.ops.load_library(_LIBRARY)

#: The registered ops (torch.ops.w4a8moe).
ops = torch.ops.w4a8moe

from . import _fake  # noqa: E402  (after the ops exist)
from . import checkpoint as _checkpoint  # noqa: E402
from .checkpoint import pack_checkpoint_linear, pack_checkpoint_moe  # noqa: E402

_fake.register()
_checkpoint.register_fake()


class PackedInfo(NamedTuple):
    """The decoded header of a packed weight tensor."""

    version: int
    layout: str
    role: str  # "w13" or "w2"
    experts: int
    rows: int  # output rows N: 2I for w13, H for w2
    cols: int  # input columns K: H for w13, I for w2
    group_size: int  # -1: one scale per row
    scale_dtype: str  # "f32", "bf16" or "f16"
    has_bias: bool
    expert_bytes: int
    total_bytes: int
    weight_format: str  # "int4_symmetric", "int4_zero_point", "mxfp4" or "int8" (linear only)
    has_input_order: bool  # w13 packed with an input order (act-order)


def packed_info(packed: torch.Tensor) -> PackedInfo:
    """Checks and decodes a packed tensor's header (RuntimeError if it is not a valid buffer)."""
    return PackedInfo(*ops.packed_info(packed))


def pack(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int = -1,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    *,
    gate_up_layout: str = "halves",
    scale_storage: str = "as_given",
    kernel_set: str = "",
    experts: Optional[Sequence[int]] = None,
    w13_zero_point: Optional[torch.Tensor] = None,
    w2_zero_point: Optional[torch.Tensor] = None,
    w13_input_order: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packs the experts once; returns (w13_packed, w2_packed), two 1-D uint8 tensors.

    w13 [E, 2I, H] and w2 [E, H, I]: int4 values as int8 in [-8, 7], or nibble-packed uint8
    with half the last dimension. Scales [E, N, K/g] (or [E, N] / [E, N, 1] when group_size is
    -1) in float32, bfloat16 or float16; optional biases [E, 2I] and [E, H].
    MXFP4 (gpt-oss): uint8 scales [E, N, K/32] are e8m0 exponents, and the weights of that
    role then uint8 e2m1 codes (element 2j in the low nibble), group_size 32; packed exactly.
    gate_up_layout: "halves" (rows [0, I) gate, [I, 2I) up) or "interleaved" (gpt-oss).
    scale_storage: "as_given" (lossless) or "bf16" (rounds scales to bfloat16).
    kernel_set: the kernel set to pack for; "" is the one forward() uses on this CPU.
    experts: the experts to pack, by index into the tensors, in this order (a rank's share of
    the layer in expert parallelism, w4a8moe.distributed); None packs all of them.
    w13_zero_point, w2_zero_point: int4 with zero points (AWQ, GPTQ, asymmetric
    compressed-tensors): int8 in [-8, 7] shaped like the scales; each element is then
    (w - z) * s (docs/operator.md, "Weight formats"), packed exactly.
    w13_input_order: act-order (GPTQ desc_act): int32 [E, H], row e a permutation; column c of
    expert e's w13 multiplies input w13_input_order[e, c], the columns sorted so that each
    group is contiguous (docs/operator.md, "Input order"). w2 takes none: reorder w13's rows.
    """
    if experts is not None:
        return ops.convert_to_w4a8_int8_moe_format_shard(
            w13, w2, w13_scale, w2_scale, group_size, torch.as_tensor(experts, dtype=torch.int64),
            w13_bias, w2_bias, gate_up_layout, scale_storage, kernel_set,
            w13_zero_point, w2_zero_point, w13_input_order,
        )
    return ops.convert_to_w4a8_int8_moe_format_ex(
        w13, w2, w13_scale, w2_scale, group_size, w13_bias, w2_bias,
        gate_up_layout, scale_storage, kernel_set, w13_zero_point, w2_zero_point,
        w13_input_order,
    )


def pack_with_original_op(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """pack() through the packing op of vLLM's schema
    (torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format, its schema and arguments): returns
    (w13_packed, w2_packed), the same bytes as pack() with its defaults (gate and up in halves,
    scales kept as given). For the engine's function of that name (six values, scales rounded to
    bfloat16): w4a8moe.vllm.convert_to_w4a8_int8_moe_format."""
    return ops.convert_to_w4a8_int8_moe_format(w13, w2, w13_scale, w2_scale, group_size,
                                               w13_bias, w2_bias)


def _sizes(w13_packed, hidden_size, intermediate_size, group_size):
    """(H, I, group size): those given, the others read from w13's packed header."""
    if hidden_size is None or intermediate_size is None or group_size is None:
        info = packed_info(w13_packed)
        hidden_size = info.cols if hidden_size is None else hidden_size
        intermediate_size = info.rows // 2 if intermediate_size is None else intermediate_size
        group_size = info.group_size if group_size is None else group_size
    return hidden_size, intermediate_size, group_size


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    *,
    activation="silu",
    apply_router_weight_on_input: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    hidden_size: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    group_size: Optional[int] = None,
) -> torch.Tensor:
    """The MoE layer: out [T, H] in x's dtype.

    x [T, H] float32/bfloat16/float16; topk_ids [T, K] int32/int64 in [0, E); topk_weights
    [T, K], used as given. hidden_size, intermediate_size and group_size are read from the
    packed headers when omitted (pass them when the packed tensors are meta or fake tensors).
    """
    hidden_size, intermediate_size, group_size = _sizes(w13_packed, hidden_size,
                                                        intermediate_size, group_size)
    return ops.dynamic_4bit_int_moe_ex(
        x, topk_ids, topk_weights, w13_packed, w2_packed, hidden_size, intermediate_size,
        group_size, apply_router_weight_on_input, activation_code(activation), alpha, limit,
    )


def pack_linear(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    *,
    bias: Optional[torch.Tensor] = None,
    weight_zero_point: Optional[torch.Tensor] = None,
    kernel_set: str = "",
) -> torch.Tensor:
    """A dense linear layer's weights packed for linear(): weight int8 [N, K] in [-8, 7] (or
    nibble-packed uint8 [N, K/2]; MXFP4: uint8 e2m1 codes with uint8 e8m0 scales, group 32),
    weight_scale [N, K/g] or [N] (group_size -1), zero points int8 shaped like the scales
    (int4 with zero points), bias [N]."""
    return ops.pack_linear(weight, weight_scale, group_size, bias, weight_zero_point, kernel_set)


def pack_linear_int8(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    kernel_set: str = "",
) -> torch.Tensor:
    """A dense linear layer's int8 weights packed for linear(): weight int8 [N, K] in
    [-128, 127] with K a multiple of 32, one scale per output row weight_scale [N] (float32,
    bfloat16 or float16), bias [N]. Element (n, k) is weight[n, k] * weight_scale[n], computed
    exactly (docs/operator.md, "Dense linear layers"): linear() reads one byte per weight at
    decode, on every kernel set. packed_info() reports the format "int8", K and group size -1.
    quantize_linear_int8() makes (weight, weight_scale) from float weights."""
    return ops.pack_linear_int8(weight, weight_scale, bias, kernel_set)


def quantize_linear_int8(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weights [N, K] (float32, bfloat16 or float16) -> (int8 values [N, K], float32
    scales [N]), symmetric per output row: scale = max|w| / 127 and values
    round(w / scale) rounded half to even (as torch.round) in [-127, 127]; an all-zero row gets
    scale 0. NaN or Inf raises RuntimeError naming the first such row. Runs on all hardware
    threads (an LM head of 150k rows takes a fraction of a second)."""
    values, scales = ops.quantize_linear_int8(weight)
    return values, scales


def linear(x: torch.Tensor, w_packed: torch.Tensor,
           out_features: Optional[int] = None) -> torch.Tensor:
    """x [..., K] float32/bfloat16/float16 -> x W^T + bias, [..., N] in x's dtype, each row of x
    quantized per row to int8 as moe() does (docs/pytorch.md, "Dense linear layers").
    out_features is read from the packed header when omitted (pass it for meta or fake
    tensors)."""
    if out_features is None:
        out_features = packed_info(w_packed).rows
    return ops.linear(x, w_packed, out_features)


def is_supported_config(
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    group_size: int = -1,
    activation="silu",
    dtype: torch.dtype = torch.bfloat16,
) -> Tuple[bool, Optional[str]]:
    """(True, None), or (False, a sentence saying why and what to do). Never raises."""
    try:
        code = activation_code(activation)
    except ValueError as e:
        return False, str(e)
    if not isinstance(dtype, torch.dtype):
        return False, f"dtype: expected a torch.dtype, got {dtype!r}"
    ok, reason = ops.is_supported_config(
        dtype, hidden_size, intermediate_size, num_experts, top_k, group_size, code
    )
    return bool(ok), (None if ok else reason)


def set_num_threads(threads: int) -> None:
    """Threads of the forward pass: 0 (the default) runs it on PyTorch's intra-op threads, as
    many as torch.get_num_threads(); n > 0 on n threads of the library's own."""
    ops.set_num_threads(threads)


def get_num_threads() -> int:
    """The thread count the next forward call will use."""
    return ops.get_num_threads()


def active_kernel_set() -> str:
    """The kernel set that packing and the forward pass use now (e.g. "avx512vnni")."""
    return ops.active_kernel_set()


def available_kernel_sets() -> list:
    """Kernel sets of this build that run on this CPU, best first."""
    return list(ops.available_kernel_sets())


def set_isa_cap(name: str) -> None:
    """Caps the kernel sets at `name` ("scalar", ...); "" removes the cap. Packed tensors made
    under another cap may need repacking."""
    ops.set_isa_cap(name)


def cpu_features() -> str:
    """The CPU features the library detected, as one line."""
    return ops.cpu_features()


def moe_routed(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    num_expert_group: int = 1,
    topk_group: int = 1,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    activation="silu",
    apply_router_weight_on_input: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    hidden_size: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    group_size: Optional[int] = None,
) -> torch.Tensor:
    """The MoE layer from the router's logits: the top-k routing and the experts in one op call
    (torch.ops.w4a8moe.moe_routed; docs/pytorch.md, "Routing inside the op"). out [T, H] in
    x's dtype.

    router_logits [T, E] float32/bfloat16/float16, E the packed experts. Per token, in float32:
    scores = softmax or sigmoid of the logits (scoring_func); the top_k experts by score plus
    e_score_correction_bias [E] (which steers the choice only), from the best topk_group of
    num_expert_group groups (a group scored by its best score, or with a correction bias by the
    sum of its two best, as vLLM's grouped top-k); weights = the chosen scores, divided by their
    sum if renormalize, times routed_scaling_factor. Ties go to the lowest expert index.
    Mixtral, Qwen3-MoE: softmax, renormalize=True. DeepSeek-V3: sigmoid, the correction bias,
    num_expert_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5.
    hidden_size, intermediate_size and group_size are read from the packed headers when
    omitted (pass them when the packed tensors are meta or fake tensors).
    """
    hidden_size, intermediate_size, group_size = _sizes(w13_packed, hidden_size,
                                                        intermediate_size, group_size)
    return ops.moe_routed(
        x, router_logits, w13_packed, w2_packed, hidden_size, intermediate_size, group_size,
        apply_router_weight_on_input, activation_code(activation), alpha, limit, top_k,
        scoring_func, renormalize, routed_scaling_factor, num_expert_group, topk_group,
        e_score_correction_bias,
    )
