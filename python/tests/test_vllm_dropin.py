"""w4a8moe.vllm: the serving engine's calls, used the way the engine uses them."""

import enum
import inspect

import pytest
import torch

import w4a8moe
from moe_data import assert_differs, assert_matches, make_inputs, make_weights
from w4a8moe.vllm import activation_kind, convert_to_w4a8_int8_moe_format, dynamic_4bit_int_moe


class MoEActivation(enum.Enum):
    """The engine's enum, as far as its values go (it lives in the engine, not installed)."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU2 = "relu2"
    SWIGLUOAI = "swigluoai"
    SWIGLUSTEP = "swiglustep"


def test_signatures_are_the_engines():
    names = list(inspect.signature(convert_to_w4a8_int8_moe_format).parameters)
    assert names == ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                     "group_size", "w13_bias", "w2_bias"]
    params = inspect.signature(convert_to_w4a8_int8_moe_format).parameters
    assert params["w13_bias"].default is None and params["w2_bias"].default is None
    names = list(inspect.signature(dynamic_4bit_int_moe).parameters)[:10]
    assert names == ["x", "topk_ids", "topk_weights", "w13_packed", "w2_packed", "hidden_size",
                     "intermediate_size", "group_size", "apply_router_weight_on_input",
                     "activation_kind"]


def test_activation_kind_has_the_engines_codes():
    assert activation_kind(MoEActivation.SWIGLUSTEP) == 0
    assert activation_kind(MoEActivation.SWIGLUOAI) == 1
    assert activation_kind(MoEActivation.SILU) == 2
    assert activation_kind(MoEActivation.GELU) == 3 == w4a8moe.Activation.GELU
    assert activation_kind("gelu_tanh") == 4 == w4a8moe.Activation.GELU_TANH
    with pytest.raises(ValueError, match="activation: expected one of swiglustep, .*, got 'relu2'"):
        activation_kind(MoEActivation.RELU2)


def engine_weights(experts, inter, hidden, group_size, seed, bias=False):
    """As the engine's layer holds them: int8 int4 values, scales [E, N, K/g] or [E, N, 1];
    here in float32, so that the engine's rounding to bfloat16 (group-wise) is visible."""
    w = make_weights(experts, inter, hidden, group_size, seed, scale_dtype=torch.float32,
                     bias=bias)
    if group_size == -1:
        w.w13_scale = w.w13_scale.reshape(experts, 2 * inter, 1)
        w.w2_scale = w.w2_scale.reshape(experts, hidden, 1)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, 64, -1])
def test_pack_and_forward_as_the_engine_calls_them(dtype, group_size):
    E, I, H, K, T = 8, 256, 512, 2, 19
    w = engine_weights(E, I, H, group_size, 3)
    result = convert_to_w4a8_int8_moe_format(
        w13_weight=w.w13, w2_weight=w.w2, w13_weight_scale=w.w13_scale,
        w2_weight_scale=w.w2_scale, group_size=group_size, w13_bias=None, w2_bias=None)
    assert isinstance(result, tuple) and len(result) == 6
    w13_packed, w2_packed, *rest = result
    assert all(isinstance(t, torch.Tensor) and t.numel() == 0 for t in rest)

    x, topk_ids, topk_weights = make_inputs(T, H, E, K, 4, dtype)
    out = dynamic_4bit_int_moe(x, topk_ids.to(torch.long), topk_weights, w13_packed, w2_packed,
                               H, I, group_size, False, activation_kind(MoEActivation.SILU))
    assert out.dtype == dtype and out.shape == (T, H)

    # The engine rounds group-wise scales to bfloat16 and keeps channel-wise ones in float32:
    # the result is exactly the library's with scales so rounded.
    scale_dtype = torch.float32 if group_size == -1 else torch.bfloat16
    p13, p2 = w4a8moe.pack(w.w13, w.w2, w.w13_scale.to(scale_dtype),
                           w.w2_scale.to(scale_dtype), group_size)
    same = w4a8moe.moe(x, topk_ids, topk_weights, p13, p2, activation="silu")
    assert torch.equal(out, same)

    # Against the exact reference of those weights, and against the float reference the
    # engine's own test uses (dequantized weights, activations not quantized).
    rounded = dict(w13_scale=w.w13_scale.to(scale_dtype), w2_scale=w.w2_scale.to(scale_dtype))
    exact = w4a8moe.reference_moe(x, topk_ids, topk_weights, w.w13, w.w2,
                                  rounded["w13_scale"], rounded["w2_scale"], group_size)
    assert_matches(out, exact, f"{dtype}, g={group_size}", tight=(dtype == torch.float32))
    floats = w4a8moe.reference_moe(x, topk_ids, topk_weights, w.w13, w.w2,
                                   rounded["w13_scale"], rounded["w2_scale"], group_size,
                                   quantize_activations=False)
    err = (out.double() - floats.double()).pow(2).mean().sqrt() / floats.double().pow(2).mean().sqrt()
    assert err < 3e-2, f"relative RMS error {err:.3g} against the float reference"
    # Not just any output of the right size: the wrong activation does not pass.
    wrong = w4a8moe.reference_moe(x, topk_ids, topk_weights, w.w13, w.w2,
                                  rounded["w13_scale"], rounded["w2_scale"], group_size,
                                  activation="gelu")
    assert_differs(out, wrong, "the gelu reference", tight=False)


@pytest.mark.parametrize("act", [MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUSTEP])
def test_biases_and_router_weight_on_input(act):
    E, I, H, K, T = 4, 128, 256, 1, 9
    w = engine_weights(E, I, H, 32, 5, bias=True)
    w.w13_bias, w.w2_bias = w.w13_bias.to(torch.bfloat16), w.w2_bias.to(torch.bfloat16)
    w13_packed, w2_packed, *_ = convert_to_w4a8_int8_moe_format(
        w.w13, w.w2, w.w13_scale, w.w2_scale, 32, w13_bias=w.w13_bias, w2_bias=w.w2_bias)
    x, ids, wts = make_inputs(T, H, E, K, 6, torch.bfloat16)
    out = dynamic_4bit_int_moe(x, ids, wts, w13_packed, w2_packed, H, I, 32, True,
                               activation_kind(act))
    ref = w4a8moe.reference_moe(x, ids, wts, w.w13, w.w2, w.w13_scale.to(torch.bfloat16),
                                w.w2_scale.to(torch.bfloat16), 32, w.w13_bias.float(),
                                w.w2_bias.float(), activation=act.value,
                                apply_router_weight_on_input=True)
    assert_matches(out, ref, act.value, tight=False)


def test_older_form_with_2i():
    E, I, H, K = 4, 128, 256, 2
    w = engine_weights(E, I, H, 64, 7)
    w13_packed, w2_packed, *_ = convert_to_w4a8_int8_moe_format(
        w.w13, w.w2, w.w13_scale, w.w2_scale, 64)
    x, ids, wts = make_inputs(6, H, E, K, 8)
    now = dynamic_4bit_int_moe(x, ids, wts, w13_packed, w2_packed, H, I, 64, False, 2)
    older = dynamic_4bit_int_moe(x, ids, wts, w13_packed, w2_packed, H, I, 2 * I, 64, False, 2)
    assert torch.equal(now, older)
    with pytest.raises(ValueError, match=r"I2: expected 2 \* intermediate_size = 256, got 255"):
        dynamic_4bit_int_moe(x, ids, wts, w13_packed, w2_packed, H, I, 2 * I - 1, 64, False, 2)


def test_errors_name_the_argument():
    E, I, H = 2, 64, 128
    w = engine_weights(E, I, H, 32, 9)
    with pytest.raises(TypeError, match="w2_weight: expected an int8 tensor"):
        convert_to_w4a8_int8_moe_format(w.w13, w.w2.float(), w.w13_scale, w.w2_scale, 32)
    w13_packed, w2_packed, *_ = convert_to_w4a8_int8_moe_format(
        w.w13, w.w2, w.w13_scale, w.w2_scale, 32)
    x, ids, wts = make_inputs(3, H, E, 1, 10)
    with pytest.raises(RuntimeError, match=r"topk_ids: expected expert ids in \[0, 2\)"):
        dynamic_4bit_int_moe(x, ids + 5, wts, w13_packed, w2_packed, H, I, 32, False, 2)
    with pytest.raises(RuntimeError, match="activation: expected a code in"):
        dynamic_4bit_int_moe(x, ids, wts, w13_packed, w2_packed, H, I, 32, False, 9)
