"""Every activation, alpha and limit, the router weight on the input, biases, group sizes 32 and
96, the gate/up layouts, weight and scale formats, strides, threads: each against the reference,
with a negative check that the tolerance tells the feature apart from its absence."""

import contextlib
import math
import multiprocessing
import os
import threading

import pytest
import torch

import w4a8moe
from moe_data import assert_differs, assert_matches, make_inputs, make_weights, rms

ACTIVATIONS = ["swiglustep", "swigluoai", "silu", "gelu", "gelu_tanh"]
# Gate and up values of about 6, so that the limit (7) of the clamped activations bites on a
# good share of them (else SWIGLUSTEP equals SILU); w2 gains keeping outputs of order one.
GAIN13 = 6.0
GAIN2 = {"swiglustep": 0.1, "swigluoai": 0.1, "silu": 0.06, "gelu": 0.06, "gelu_tanh": 0.06}


def small_case(seed=0, tokens=40, **weight_options):
    weights = make_weights(8, 128, 256, 64, seed, **weight_options)
    x, ids, wts = make_inputs(tokens, 256, 8, 2, seed)
    return weights, x, ids, wts


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation(activation):
    weights, x, ids, wts = small_case(gain13=GAIN13, gain2=GAIN2[activation])
    w13_packed, w2_packed = weights.pack()
    out = w4a8moe.moe(x, ids, wts, w13_packed, w2_packed, activation=activation)
    assert_matches(out, weights.reference(x, ids, wts, activation=activation), activation)
    code_out = torch.ops.w4a8moe.dynamic_4bit_int_moe(
        x, ids, wts, w13_packed, w2_packed, 256, 128, 64, False,
        int(w4a8moe.Activation[activation.upper()]))
    assert torch.equal(code_out, out)
    for other in ACTIVATIONS:
        if other != activation and {other, activation} != {"gelu", "gelu_tanh"}:  # see below
            wrong = weights.reference(x, ids, wts, activation=other)
            assert_differs(out, wrong, f"{other} instead of {activation}")
    expert0 = w4a8moe.dequantize_weights(weights.w13[:1], weights.w13_scale[:1], 64)[0]
    assert ((x @ expert0.T.float()).abs() > 7).float().mean() > 0.1  # the limit is reached


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_forms_told_apart(activation):
    """The erf and tanh forms differ by at most 5e-4 (near -2.7), below the int8 step of a
    typical intermediate row; gate values all near -2.7 (gate weights small, gate biases -2.7)
    make the difference 5% of every output."""
    weights, x, ids, wts = small_case(bias=True, gain2=60.0)
    inter = weights.w13.shape[1] // 2
    weights.w13_scale[:, :inter] *= 0.02
    weights.w13_bias[:, :inter] = -2.7
    weights.w13_bias[:, inter:] = 0.0
    out = w4a8moe.moe(x, ids, wts, *weights.pack(), activation=activation)
    # Loose bound only: 1 + erf(g / sqrt 2) cancels near -2.7, so the kernel's float32 erf is
    # off by about 1e-5 there, and every row has requantization steps of its own.
    ref = weights.reference(x, ids, wts, activation=activation)
    assert_matches(out, ref, activation, tight=False)
    other = "gelu_tanh" if activation == "gelu" else "gelu"
    assert_differs(out, weights.reference(x, ids, wts, activation=other), other, tight=False)


@pytest.mark.parametrize("activation", ["swigluoai", "swiglustep"])
def test_alpha_and_limit(activation):
    weights, x, ids, wts = small_case(gain13=GAIN13, gain2=GAIN2[activation])
    w13_packed, w2_packed = weights.pack()
    out = w4a8moe.moe(x, ids, wts, w13_packed, w2_packed, activation=activation, alpha=1.25,
                      limit=5.0)
    assert_matches(out, weights.reference(x, ids, wts, activation=activation, alpha=1.25,
                                          limit=5.0), activation)
    assert_differs(out, weights.reference(x, ids, wts, activation=activation), "the defaults")
    raw = torch.ops.w4a8moe.dynamic_4bit_int_moe_ex(
        x, ids, wts, w13_packed, w2_packed, 256, 128, 64, False,
        int(w4a8moe.Activation[activation.upper()]), 1.25, 5.0)
    assert torch.equal(raw, out)


def test_apply_router_weight_on_input():
    weights, x, ids, wts = small_case()
    w13_packed, w2_packed = weights.pack()
    out = w4a8moe.moe(x, ids, wts, w13_packed, w2_packed, apply_router_weight_on_input=True)
    ref = weights.reference(x, ids, wts, apply_router_weight_on_input=True)
    assert_matches(out, ref, "apply on input")
    assert_differs(out, weights.reference(x, ids, wts), "the router weight on the output")


def test_biases():
    weights, x, ids, wts = small_case(bias=True)
    w13_packed, w2_packed = weights.pack()
    assert w4a8moe.packed_info(w13_packed).has_bias and w4a8moe.packed_info(w2_packed).has_bias
    out = w4a8moe.moe(x, ids, wts, w13_packed, w2_packed)
    assert_matches(out, weights.reference(x, ids, wts), "biases")
    weights.w13_bias = weights.w2_bias = None
    assert_differs(out, weights.reference(x, ids, wts), "no biases")


@pytest.mark.parametrize("group_size", [32, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_sizes(group_size, dtype):
    weights = make_weights(4, 192, 384, group_size, 7)
    x, ids, wts = make_inputs(33, 384, 4, 2, 7, dtype)
    out = w4a8moe.moe(x, ids, wts, *weights.pack())
    assert w4a8moe.packed_info(weights.pack()[0]).group_size == group_size
    assert w4a8moe.packed_info(weights.pack()[0]).weight_format == "int4_symmetric"
    assert_matches(out, weights.reference(x, ids, wts), f"g={group_size}")


def test_interleaved_gate_up():
    weights, x, ids, wts = small_case(gate_up_layout="interleaved", bias=True)
    out = w4a8moe.moe(x, ids, wts, *weights.pack())
    assert_matches(out, weights.reference(x, ids, wts), "interleaved")
    assert_differs(out, weights.reference(x, ids, wts, gate_up_layout="halves"), "halves")


def nibbles(w):
    """int8 [E, N, K] -> uint8 [E, N, K/2]: element 2j in the low nibble, as value + 8."""
    u = (w.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def test_nibble_packed_weights_pack_to_the_same_bytes():
    weights, x, ids, wts = small_case(bias=True)
    w13_packed, w2_packed = weights.pack()
    n13, n2 = w4a8moe.pack(nibbles(weights.w13), nibbles(weights.w2), weights.w13_scale,
                           weights.w2_scale, 64, weights.w13_bias, weights.w2_bias)
    assert torch.equal(n13, w13_packed) and torch.equal(n2, w2_packed)
    # The reference reads nibble-packed weights too.
    ref = w4a8moe.reference_moe(x, ids, wts, nibbles(weights.w13), nibbles(weights.w2),
                                 weights.w13_scale, weights.w2_scale, 64, weights.w13_bias,
                                 weights.w2_bias)
    assert torch.equal(ref, weights.reference(x, ids, wts))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_dtypes(scale_dtype):
    weights, x, ids, wts = small_case(scale_dtype=scale_dtype)
    w13_packed, w2_packed = weights.pack()
    name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[scale_dtype]
    assert w4a8moe.packed_info(w13_packed).scale_dtype == name  # kept as given
    out = w4a8moe.moe(x, ids, wts, w13_packed, w2_packed)
    assert_matches(out, weights.reference(x, ids, wts), str(scale_dtype))


def test_scale_storage_bf16_rounds_the_scales():
    weights, x, ids, wts = small_case(scale_dtype=torch.float32)
    w13_packed, w2_packed = weights.pack(scale_storage="bf16")
    assert w4a8moe.packed_info(w13_packed).scale_dtype == "bf16"
    out = w4a8moe.moe(x, ids, wts, w13_packed, w2_packed)
    weights.w13_scale = weights.w13_scale.bfloat16()
    weights.w2_scale = weights.w2_scale.bfloat16()
    assert_matches(out, weights.reference(x, ids, wts), "bf16 storage")


def test_channelwise_scales_two_or_three_dimensional():
    weights = make_weights(4, 128, 256, -1, 3)
    x, ids, wts = make_inputs(20, 256, 4, 2, 3)
    out = w4a8moe.moe(x, ids, wts, *weights.pack())
    assert weights.w13_scale.dim() == 3  # [E, N, 1], as vLLM's test makes them
    weights.w13_scale = weights.w13_scale[..., 0]
    weights.w2_scale = weights.w2_scale[..., 0]
    assert torch.equal(w4a8moe.moe(x, ids, wts, *weights.pack()), out)
    assert_matches(out, weights.reference(x, ids, wts), "channelwise")


def test_index_and_weight_dtypes():
    weights, x, ids, wts = small_case()
    packed = weights.pack()
    out = w4a8moe.moe(x, ids, wts, *packed)
    assert torch.equal(w4a8moe.moe(x, ids.to(torch.int32), wts, *packed), out)
    for dtype in (torch.bfloat16, torch.float16):
        low = wts.to(dtype)
        assert_matches(w4a8moe.moe(x, ids, low, *packed), weights.reference(x, ids, low), dtype)


def test_strided_inputs_give_the_same_bits():
    weights, x, ids, wts = small_case()
    packed = weights.pack()
    out = w4a8moe.moe(x, ids, wts, *packed)
    wide = torch.zeros(x.shape[0], x.shape[1] + 40)
    wide[:, 3:3 + x.shape[1]] = x
    assert not wide[:, 3:3 + x.shape[1]].is_contiguous()
    assert torch.equal(w4a8moe.moe(wide[:, 3:3 + x.shape[1]], ids, wts, *packed), out)
    assert torch.equal(w4a8moe.moe(x.T.contiguous().T, ids.T.contiguous().T, wts, *packed), out)


def test_repeated_expert_ids_count_twice():
    weights, x, ids, wts = small_case()
    ids[:, 1] = ids[:, 0]
    out = w4a8moe.moe(x, ids, wts, *weights.pack())
    assert_matches(out, weights.reference(x, ids, wts), "repeated ids")


def test_nan_row_stays_in_its_token():
    weights, x, ids, wts = small_case()
    packed = weights.pack()
    clean = w4a8moe.moe(x, ids, wts, *packed)
    x[5, 17] = float("nan")
    out = w4a8moe.moe(x, ids, wts, *packed)
    assert torch.isnan(out[5]).all()
    others = torch.arange(x.shape[0]) != 5
    assert torch.equal(out[others], clean[others])


def test_empty_batch():
    weights, x, ids, wts = small_case()
    out = w4a8moe.moe(x[:0], ids[:0], wts[:0], *weights.pack())
    assert out.shape == (0, 256) and out.dtype == x.dtype


def test_int8_activations_cost_little_against_the_float_reference():
    weights, x, ids, wts = small_case(tokens=64)
    out = w4a8moe.moe(x, ids, wts, *weights.pack())
    float_ref = weights.reference(x, ids, wts, quantize_activations=False)
    rel = rms(out.double() - float_ref.double()) / rms(float_ref)
    # int8 rows of Gaussian-like data: about 1% (docs/operator.md, "Accuracy"; a few 1e-3 was
    # hoped for on typical data); not zero: the activations are quantized.
    assert 1e-3 < rel < 3e-2, rel


def test_threads_give_the_same_bits():
    weights, x, ids, wts = small_case(tokens=100)
    packed = weights.pack()
    results, previous = [], w4a8moe.get_num_threads()
    torch_threads = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            w4a8moe.set_num_threads(threads)
            assert w4a8moe.get_num_threads() == threads
            results.append(w4a8moe.moe(x, ids, wts, *packed))
        w4a8moe.set_num_threads(0)  # PyTorch's intra-op threads
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            assert w4a8moe.get_num_threads() == threads
            results.append(w4a8moe.moe(x, ids, wts, *packed))
    finally:
        w4a8moe.set_num_threads(previous)
        torch.set_num_threads(torch_threads)
    assert len(results) == 7
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_op_runs_on_torch_threads(threads):
    # each of torch's threads ran tasks (an extension built without OpenMP would run at::parallel_for
    # on the calling thread alone: right bits, one core)
    weights, x, ids, wts = small_case(tokens=16)
    packed = weights.pack()
    with on_torch_threads(threads):
        w4a8moe.moe(x, ids, wts, *packed)
        assert torch.ops.w4a8moe._torch_threads_used() == threads
    previous = w4a8moe.get_num_threads()
    w4a8moe.set_num_threads(2)
    try:
        w4a8moe.moe(x, ids, wts, *packed)
        assert torch.ops.w4a8moe._torch_threads_used() == 0  # the library's own threads
    finally:
        w4a8moe.set_num_threads(previous)


@contextlib.contextmanager
def on_torch_threads(threads):
    """The op on PyTorch's intra-op threads (w4a8moe.set_num_threads(0)), `threads` of them."""
    previous, torch_threads = w4a8moe.get_num_threads(), torch.get_num_threads()
    w4a8moe.set_num_threads(0)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        w4a8moe.set_num_threads(previous)
        torch.set_num_threads(torch_threads)


@pytest.mark.parametrize("source", ["own", "torch"])
def test_concurrent_calls_from_python_threads(source):
    weights, x, ids, wts = small_case(tokens=64)
    packed = weights.pack()
    expected = w4a8moe.moe(x, ids, wts, *packed)
    with on_torch_threads(2) if source == "torch" else contextlib.nullcontext():
        results, errors = concurrent_calls(x, ids, wts, packed)
    assert not errors
    assert all(torch.equal(r, expected) for r in results)


def concurrent_calls(x, ids, wts, packed):
    results, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(10):
                results[i] = w4a8moe.moe(x, ids, wts, *packed)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def _child(queue, tensors):
    queue.put(w4a8moe.moe(*tensors).tolist())  # plain data: tensors would be shared by fd


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.parametrize("source", ["own", "torch"])
def test_forked_child_can_call_the_op(source):
    weights, x, ids, wts = small_case(tokens=8)
    tensors = (x, ids, wts, *weights.pack())
    with on_torch_threads(2) if source == "torch" else contextlib.nullcontext():
        expected = w4a8moe.moe(*tensors)  # the parent's worker threads exist now
        got = result_in_forked_child(tensors)
    assert torch.equal(torch.tensor(got, dtype=expected.dtype), expected)


def result_in_forked_child(tensors):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, tensors))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    return got


# MXFP4 (gpt-oss's experts): uint8 scales are e8m0 exponents and the weights e2m1 codes; the op
# packs them exactly. The reference gets their meaning as integers 2 * e2m1 with float scales
# 2^(e - 128), written here from the OCP definition.
E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                            dtype=torch.int8)


def mxfp4_tensors(experts, rows, cols, gain, gen):
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=gen)
    values = torch.stack((E2M1_DOUBLED[(codes & 15).long()], E2M1_DOUBLED[(codes >> 4).long()]),
                         dim=-1).flatten(-2)
    # the power of two nearest a scale that makes the dot products of order one
    target = (0.5 + torch.rand(experts, rows, cols // 32, generator=gen)) * gain / (
        5.9 * math.sqrt(cols))
    exponents = (torch.log2(target).round() + 128).to(torch.uint8)
    return codes, exponents, values, torch.pow(2.0, exponents.double() - 128).float()


@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_mxfp4_weights_match_the_reference(layout):
    gen = torch.Generator().manual_seed(7)
    E, I, H = 8, 64, 128
    c13, e13, v13, s13 = mxfp4_tensors(E, 2 * I, H, 1.5, gen)
    c2, e2, v2, s2 = mxfp4_tensors(E, H, I, 1.0, gen)
    b13, b2 = 0.3 * torch.randn(E, 2 * I, generator=gen), 0.3 * torch.randn(E, H, generator=gen)
    x, ids, wts = make_inputs(24, H, E, 2, 3)
    p13, p2 = w4a8moe.pack(c13, c2, e13, e2, 32, b13, b2, gate_up_layout=layout)
    assert w4a8moe.packed_info(p13).scale_dtype == "bf16"
    assert w4a8moe.packed_info(p13).weight_format == "mxfp4"
    out = w4a8moe.moe(x, ids, wts, p13, p2, activation="swigluoai")
    ref = w4a8moe.reference_moe(x, ids, wts, v13, v2, s13, s2, 32, b13, b2,
                                activation="swigluoai", gate_up_layout=layout)
    assert_matches(out, ref, f"mxfp4 {layout}")
    # read as int4 nibbles with the same scales, they would mean something else
    wrong = w4a8moe.reference_moe(x, ids, wts, c13, c2, s13, s2, 32, b13, b2,
                                  activation="swigluoai", gate_up_layout=layout)
    assert_differs(out, wrong, "mxfp4 read as int4")
    # the meta kernel gives the packed sizes from shapes and dtypes alone
    meta = [t.to("meta") for t in (c13, c2, e13, e2)]
    f13, f2 = torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format_ex(
        *meta, 32, b13.to("meta"), b2.to("meta"), layout, "as_given", "")
    assert (f13.shape, f2.shape) == (p13.shape, p2.shape)


def zero_point_tensors(experts, rows, cols, group_size, gain, gen):
    """int4 values and zero points in [-8, 7] (one per row and group), scales; and w - z."""
    groups = 1 if group_size == -1 else cols // group_size
    w = torch.randint(-8, 8, (experts, rows, cols), dtype=torch.int8, generator=gen)
    z = torch.randint(-8, 8, (experts, rows, groups), dtype=torch.int8, generator=gen)
    meaning = (w.view(experts, rows, groups, -1) - z[..., None]).view(experts, rows, cols)
    s = (0.5 + torch.rand(experts, rows, groups, generator=gen)) * gain / (6.0 * math.sqrt(cols))
    if group_size == -1:
        z, s = z[..., 0], s[..., 0]
    return w, z, s, meaning


@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_zero_point_weights_match_the_reference(group_size):
    gen = torch.Generator().manual_seed(11)
    E, I, H = 8, 64, 128
    w13, z13, s13, v13 = zero_point_tensors(E, 2 * I, H, group_size, 1.5, gen)
    w2, z2, s2, v2 = zero_point_tensors(E, H, I, group_size, 1.0, gen)
    x, ids, wts = make_inputs(24, H, E, 2, 5)
    p13, p2 = w4a8moe.pack(w13, w2, s13, s2, group_size, w13_zero_point=z13, w2_zero_point=z2)
    assert w4a8moe.packed_info(p13).weight_format == "int4_zero_point"
    out = w4a8moe.moe(x, ids, wts, p13, p2)
    # the reference takes the meaning w - z as its integer weights (int8, in [-15, 15])
    ref = w4a8moe.reference_moe(x, ids, wts, v13, v2, s13, s2, group_size)
    assert_matches(out, ref, f"zero points g{group_size}")
    # a rank's share packs the same way
    s13_, s2_ = w4a8moe.pack(w13, w2, s13, s2, group_size, experts=[5, 1],
                             w13_zero_point=z13, w2_zero_point=z2)
    assert w4a8moe.packed_info(s13_).experts == 2
    assert w4a8moe.packed_info(s2_).weight_format == "int4_zero_point"


def test_zero_point_refusals_name_the_argument():
    gen = torch.Generator().manual_seed(12)
    w13, z13, s13, _ = zero_point_tensors(2, 64, 64, 32, 1.0, gen)
    w2, z2, s2, _ = zero_point_tensors(2, 64, 32, 32, 1.0, gen)
    bad = z2.clone()
    bad[1, 3, 0] = 8
    with pytest.raises(RuntimeError, match=r"w2_zero_point.*\[-8, 7\].*got 8 at \[1, 3, 0\]"):
        w4a8moe.pack(w13, w2, s13, s2, 32, w13_zero_point=z13, w2_zero_point=bad)
    with pytest.raises(RuntimeError, match="w13_zero_point.*expected dtype i8"):
        w4a8moe.pack(w13, w2, s13, s2, 32, w13_zero_point=z13.to(torch.uint8),
                     w2_zero_point=z2)


def test_mxfp4_refusals_name_the_argument():
    gen = torch.Generator().manual_seed(8)
    c13, e13, _, _ = mxfp4_tensors(2, 64, 64, 1.0, gen)
    c2, e2, _, _ = mxfp4_tensors(2, 64, 32, 1.0, gen)
    bad = e2.clone()
    bad[1, 3, 0] = 255
    with pytest.raises(RuntimeError, match=r"w2_scale: expected e8m0 exponents in \[0, 254\], "
                                           r"got 255 \(NaN\) at \[1, 3, 0\]"):
        w4a8moe.pack(c13, c2, e13, bad, 32)
    with pytest.raises(RuntimeError, match="group_size: expected 32 for mxfp4 weights"):
        w4a8moe.pack(c13, c2, e13, e2, 64)
    with pytest.raises(RuntimeError, match=r"w13: expected dtype u8 \(mxfp4 e2m1 codes"):
        w4a8moe.pack(torch.zeros(2, 64, 64, dtype=torch.int8),
                     torch.zeros(2, 64, 32, dtype=torch.int8), e13, e2, 32)


def test_input_order_gathers_x_per_expert():
    # act-order: column c of expert e's w13 multiplies x[:, order[e, c]]. With one slot per
    # token the layer equals the plain one on x's rows gathered by their expert's order, to the
    # bit (a quantized value does not depend on the order), and with one order for all experts
    # the plain layer on x[:, order].
    gen = torch.Generator().manual_seed(21)
    E, I, H, g = 4, 64, 128, 32
    w13, z13, s13, _ = zero_point_tensors(E, 2 * I, H, g, 1.5, gen)
    w2, z2, s2, _ = zero_point_tensors(E, H, I, g, 1.0, gen)
    order = torch.stack([torch.randperm(H, generator=gen) for _ in range(E)]).to(torch.int32)
    x, ids, wts = make_inputs(16, H, E, 1, 6)
    p13, p2 = w4a8moe.pack(w13, w2, s13, s2, g, w13_zero_point=z13, w2_zero_point=z2,
                           w13_input_order=order)
    assert w4a8moe.packed_info(p13).has_input_order
    assert not w4a8moe.packed_info(p2).has_input_order
    q13, q2 = w4a8moe.pack(w13, w2, s13, s2, g, w13_zero_point=z13, w2_zero_point=z2)
    out = w4a8moe.moe(x, ids, wts, p13, p2)
    gathered = torch.stack([x[t, order[ids[t, 0]].long()] for t in range(x.shape[0])])
    assert torch.equal(out, w4a8moe.moe(gathered, ids, wts, q13, q2))
    assert_differs(out, w4a8moe.moe(x, ids, wts, q13, q2), "the order must matter")
    # two slots, one order for every expert
    x2, ids2, wts2 = make_inputs(16, H, E, 2, 7)
    same = order[:1].expand(E, H).contiguous()
    r13, r2 = w4a8moe.pack(w13, w2, s13, s2, g, w13_zero_point=z13, w2_zero_point=z2,
                           w13_input_order=same)
    assert torch.equal(w4a8moe.moe(x2, ids2, wts2, r13, r2),
                       w4a8moe.moe(x2[:, order[0].long()].contiguous(), ids2, wts2, q13, q2))
    # a rank's share takes the order too
    s13_, _ = w4a8moe.pack(w13, w2, s13, s2, g, experts=[3, 1], w13_zero_point=z13,
                           w2_zero_point=z2, w13_input_order=order)
    assert w4a8moe.packed_info(s13_).has_input_order
    # refusals name the argument
    bad = order.clone()
    bad[2, 5] = bad[2, 6]
    with pytest.raises(RuntimeError, match=r"PackOptions::input_order: .*twice in row 2"):
        w4a8moe.pack(w13, w2, s13, s2, g, w13_zero_point=z13, w2_zero_point=z2,
                     w13_input_order=bad)
    with pytest.raises(RuntimeError, match=r"w13_input_order: expected an int32 tensor \[E, H\]"):
        w4a8moe.pack(w13, w2, s13, s2, g, w13_zero_point=z13, w2_zero_point=z2,
                     w13_input_order=order.long())
    # the meta kernel gives the packed sizes with the order
    meta = [t.to("meta") for t in (w13, w2, s13, s2)]
    fake = torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format_ex(
        *meta, g, None, None, "halves", "as_given", "", z13.to("meta"), z2.to("meta"),
        order.to("meta"))
    assert [f.shape for f in fake] == [p13.shape, p2.shape]
