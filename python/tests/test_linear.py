"""The dense linear ops (torch.ops.w4a8moe.pack_linear / linear, w4a8moe.pack_linear / linear)
against a plain-torch reference of the contract: each row of x quantized per row to int8
(w4a8moe.reference.quant_row), exact integer sums per weight group, the group scales and the
bias in float64. Tolerance: 1e-6 * sqrt(K) of the row's largest output (f32 sums), plus the
rounding of the output to bfloat16 / float16. Then shapes, the meta kernels, the errors, and
(torch 2) torch.library.opcheck. Last the int8 format (pack_linear_int8, quantize_linear_int8)
against torch's float matmul of the dequantized int8 weights with the row-quantized x.
"""

import math

import pytest
import torch

import w4a8moe
from w4a8moe.reference import quant_row

E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                            dtype=torch.float64)


def make(rows, cols, group, fmt="int4", dtype=torch.float32, bias=False, seed=0):
    """(pack_linear's arguments, the reference's integer weights [N, K] and scales [N, G])."""
    gen = torch.Generator().manual_seed(seed)
    g = cols if group == -1 else group
    groups = cols // g
    args = {}
    if fmt == "mxfp4":
        codes = torch.randint(0, 16, (rows, cols), generator=gen)
        exps = torch.randint(119, 122, (rows, groups), generator=gen, dtype=torch.uint8)
        args.update(weight=(codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8),
                    weight_scale=exps)
        ref_w = E2M1_DOUBLED[codes]
        ref_s = torch.pow(2.0, exps.to(torch.float64) - 128)
    else:
        w = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
        s = ((torch.rand(rows, groups, generator=gen) * 0.5 + 0.75) * 2 / (7 * math.sqrt(cols))
             ).to(dtype)
        args.update(weight=w, weight_scale=s if group != -1 else s[:, 0])
        ref_w, ref_s = w.to(torch.float64), s.to(torch.float64)
        if fmt == "int4_zp":
            z = torch.randint(-3, 4, (rows, groups), generator=gen, dtype=torch.int8)
            args["weight_zero_point"] = z if group != -1 else z[:, 0]
            ref_w = ref_w - z.to(torch.float64).repeat_interleave(g, 1)
    if bias:
        args["bias"] = torch.randn(rows, generator=gen) * 0.1
    return args, ref_w, ref_s, (32 if fmt == "mxfp4" else group)


def reference(x, ref_w, ref_s, group, bias):
    rows2 = x.reshape(-1, x.shape[-1]).float()
    q, zp, recip = quant_row(rows2)
    a = (q - zp).to(torch.float64)
    cols = a.shape[1]
    g = cols if group == -1 else group
    sums = torch.einsum("pgk,ngk->png", a.view(-1, cols // g, g), ref_w.view(-1, cols // g, g))
    out = (sums * ref_s.unsqueeze(0)).sum(-1) * recip.to(torch.float64)
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.reshape(*x.shape[:-1], ref_w.shape[0])


def assert_matches(got, ref, cols):
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(got.dtype, 0.0)
    got64 = got.to(torch.float64).reshape(-1, ref.shape[-1])
    ref2 = ref.reshape(-1, ref.shape[-1])
    assert 0.1 <= ref2.abs().max().item() <= 100, "outputs not of order one"
    bound = 1e-6 * math.sqrt(cols) * ref2.abs().amax(-1, keepdim=True) + u * ref2.abs() + 2 ** -24
    err = (got64 - ref2).abs()
    assert bool((err <= bound).all()), f"worst {err.max().item()} at {err.argmax().item()}"


CASES = [  # (rows, cols, group, format, dtype, bias, x shape less K)
    (256, 512, 32, "int4", torch.float32, False, (1,)),
    (320, 256, 128, "int4_zp", torch.bfloat16, True, (37,)),
    (192, 1024, -1, "int4", torch.float16, False, (3, 43)),
    (96, 96, 32, "mxfp4", torch.bfloat16, True, (5,)),
    (200, 384, -1, "int4_zp", torch.float32, True, (9,)),
]


@pytest.mark.parametrize("rows,cols,group,fmt,dtype,bias,lead", CASES,
                         ids=[f"{c[3]}-g{c[2]}-{str(c[4]).split('.')[-1]}-{'x'.join(map(str, c[6]))}"
                              for c in CASES])
def test_linear_matches_reference(rows, cols, group, fmt, dtype, bias, lead):
    args, ref_w, ref_s, g = make(rows, cols, group, fmt, dtype, bias)
    packed = w4a8moe.pack_linear(group_size=g, **args)
    info = w4a8moe.packed_info(packed)
    assert (info.role, info.experts, info.rows, info.cols) == ("w2", 1, rows, cols)
    x = torch.randn(*lead, cols).to(dtype)
    out = w4a8moe.linear(x, packed)
    assert out.shape == (*lead, rows) and out.dtype == dtype
    assert_matches(out, reference(x, ref_w, ref_s, g, args.get("bias")), cols)


def test_comparison_can_fail():
    args, ref_w, ref_s, g = make(128, 256, 32)
    x = torch.randn(4, 256)
    out = w4a8moe.linear(x, w4a8moe.pack_linear(group_size=g, **args))
    assert_matches(out, reference(x, ref_w, ref_s, g, None), 256)
    ref_s = ref_s.clone()
    ref_s[3, 2] *= 1.1  # one group of one row 10% off
    with pytest.raises(AssertionError):
        assert_matches(out, reference(x, ref_w, ref_s, g, None), 256)


def test_empty_and_strided_inputs():
    args, ref_w, ref_s, g = make(64, 128, 32)
    packed = w4a8moe.pack_linear(group_size=g, **args)
    assert w4a8moe.linear(torch.empty(0, 128), packed).shape == (0, 64)
    wide = torch.randn(6, 256)
    x = wide[:, :128]  # rows strided
    assert_matches(w4a8moe.linear(x, packed), reference(x, ref_w, ref_s, g, None), 128)


def test_meta_kernels_agree_with_cpu():
    args, _, _, g = make(320, 256, 128, "int4_zp", bias=True)
    packed = w4a8moe.pack_linear(group_size=g, **args)
    meta = {k: v.to("meta") for k, v in args.items()}
    assert w4a8moe.ops.pack_linear(meta["weight"], meta["weight_scale"], g, meta["bias"],
                                   meta["weight_zero_point"]).shape == packed.shape
    out = w4a8moe.ops.linear(torch.empty(7, 256, device="meta", dtype=torch.bfloat16),
                             packed.to("meta"), 320)
    assert out.shape == (7, 320) and out.dtype == torch.bfloat16


def test_errors_name_the_argument():
    args, _, _, g = make(64, 128, 32)
    packed = w4a8moe.pack_linear(group_size=g, **args)
    with pytest.raises(RuntimeError, match=r"out_features: expected 64 \(the rows of w_packed\)"):
        w4a8moe.ops.linear(torch.randn(2, 128), packed, 32)
    with pytest.raises(RuntimeError, match="x: expected 128 columns"):
        w4a8moe.linear(torch.randn(2, 96), packed)
    with pytest.raises(RuntimeError, match="x: expected dtype float32, bfloat16 or float16"):
        w4a8moe.linear(torch.randn(2, 128).double(), packed)
    with pytest.raises(RuntimeError, match=r"weight: expected rank 2 \[N, K\]"):
        w4a8moe.pack_linear(args["weight"][None], args["weight_scale"], g)
    with pytest.raises(RuntimeError, match="w_scale"):
        w4a8moe.pack_linear(args["weight"], args["weight_scale"][:, :2], g)
    bad = args["weight"].clone()
    bad[0, 0] = 9
    with pytest.raises(RuntimeError, match=r"w: expected int4 values in \[-8, 7\], got 9"):
        w4a8moe.pack_linear(bad, args["weight_scale"], g)
    moe_w13, _ = w4a8moe.ops.convert_to_w4a8_int8_moe_format(
        torch.zeros(2, 64, 128, dtype=torch.int8), torch.zeros(2, 128, 32, dtype=torch.int8),
        torch.ones(2, 64, 4), torch.ones(2, 128, 1), 32)
    with pytest.raises(RuntimeError, match="w_packed: expected a linear layer's weights"):
        w4a8moe.ops.linear(torch.randn(2, 128), moe_w13, 64)


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck: torch 2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_linear(dtype):
    args, _, _, g = make(96, 128, 32, "int4_zp", bias=True)
    packed = w4a8moe.pack_linear(group_size=g, **args)
    torch.library.opcheck(torch.ops.w4a8moe.linear.default,
                          (torch.randn(5, 128).to(dtype), packed, 96))
    torch.library.opcheck(torch.ops.w4a8moe.pack_linear.default,
                          (args["weight"], args["weight_scale"], g, args["bias"],
                           args["weight_zero_point"]))


@pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2, reason="torch.compile: torch 2")
def test_compiles_with_dynamic_tokens():
    args, ref_w, ref_s, g = make(64, 128, 32)
    packed = w4a8moe.pack_linear(group_size=g, **args)
    f = torch.compile(lambda x: w4a8moe.ops.linear(x, packed, 64) * 2, dynamic=True,
                      fullgraph=True)
    for tokens in (3, 9):
        x = torch.randn(tokens, 128)
        assert_matches(f(x) / 2, reference(x, ref_w, ref_s, g, None), 128)


# ---- int8 weights (pack_linear_int8, quantize_linear_int8) ---------------------------------

def make_int8(rows, cols, scale_dtype=torch.float32, bias=False, seed=0):
    """(weight int8 [N, K], weight_scale [N], bias or None): rows n % 8 == 0 all -128, == 1 all
    127, == 2 alternating, the rest uniform in [-128, 127]; scales make outputs of order one."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    w[0::8] = -128
    w[1::8] = 127
    w[2::8, 0::2], w[2::8, 1::2] = -128, 127
    norm = w.to(torch.float64).pow(2).sum(1).sqrt()
    s = ((torch.rand(rows, generator=gen, dtype=torch.float64) * 0.5 + 0.75) / norm)
    b = torch.randn(rows, generator=gen) * 0.1 if bias else None
    return w, s.to(scale_dtype), b


def reference_int8(x, w, s, bias):
    """torch's float matmul of the dequantized weights with the row-quantized x (float64)."""
    rows2 = x.reshape(-1, x.shape[-1]).float()
    q, zp, recip = quant_row(rows2)
    xq = (q - zp).to(torch.float64) * recip.to(torch.float64)
    out = xq @ (w.to(torch.float64) * s.to(torch.float64)[:, None]).T
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.reshape(*x.shape[:-1], w.shape[0])


def assert_matches_int8(got, ref, x, w, s):
    """assert_matches plus 1e-6 * recip * |zp| * s[n] * SUM (|w| + 30): each int8 plane is
    summed over the raw q in f32 and the zero-point term subtracted after (a large zero point,
    an all-zero row of x, cancels them)."""
    rows2 = x.reshape(-1, x.shape[-1]).float()
    _, zp, recip = quant_row(rows2)
    wabs = s.to(torch.float64) * (w.to(torch.float64).abs() + 30).sum(1)
    extra = 1e-6 * (recip.to(torch.float64) * zp.to(torch.float64).abs()) * wabs[None, :]
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(got.dtype, 0.0)
    got64 = got.to(torch.float64).reshape(-1, ref.shape[-1])
    ref2 = ref.reshape(-1, ref.shape[-1])
    cols = x.shape[-1]
    assert 0.1 <= ref2.abs().max().item() <= 100, "outputs not of order one"
    bound = (1e-6 * math.sqrt(cols) * ref2.abs().amax(-1, keepdim=True) + u * ref2.abs() + extra
             + 2 ** -24)
    err = (got64 - ref2).abs()
    assert bool((err <= bound).all()), f"worst {err.max().item()} at {err.argmax().item()}"


INT8_CASES = [  # (rows, cols, x dtype, scale dtype, bias, x shape less K)
    (77, 32, torch.float32, torch.float32, False, (1,)),
    (45, 32, torch.bfloat16, torch.bfloat16, True, (130,)),
    (203, 2880, torch.float16, torch.float16, False, (3,)),
    (333, 2880, torch.float32, torch.bfloat16, True, (17,)),
    (130, 4096, torch.bfloat16, torch.float32, False, (2, 65)),
]


@pytest.mark.parametrize("rows,cols,dtype,scale_dtype,bias,lead", INT8_CASES,
                         ids=[f"n{c[0]}-k{c[1]}-{str(c[2]).split('.')[-1]}-"
                              f"{'x'.join(map(str, c[5]))}" for c in INT8_CASES])
def test_linear_int8_matches_reference(rows, cols, dtype, scale_dtype, bias, lead):
    w, s, b = make_int8(rows, cols, scale_dtype, bias)
    packed = w4a8moe.pack_linear_int8(w, s, bias=b)
    info = w4a8moe.packed_info(packed)
    assert (info.role, info.experts, info.rows, info.cols, info.group_size, info.weight_format,
            info.scale_dtype) == ("w2", 1, rows, cols, -1, "int8",
                                  {torch.float32: "f32", torch.bfloat16: "bf16",
                                   torch.float16: "f16"}[scale_dtype])
    x = torch.randn(*lead, cols).to(dtype)
    if x.numel() >= 3 * cols:  # an all-zero row, a constant row, an outlier
        flat = x.view(-1, cols)
        flat[0], flat[1], flat[2, 5] = 0, 0.75, 40
    out = w4a8moe.linear(x, packed)
    assert out.shape == (*lead, rows) and out.dtype == dtype
    assert_matches_int8(out, reference_int8(x, w, s, b), x, w, s)


def test_linear_int8_comparison_sees_one_step():
    """A change of one unit in one row's weights (the low nibbles' step) fails the check, so a
    wrong mapping of the low or high nibbles cannot pass."""
    w, s, _ = make_int8(96, 2880)
    x = torch.randn(5, 2880)
    out = w4a8moe.linear(x, w4a8moe.pack_linear_int8(w, s))
    assert_matches_int8(out, reference_int8(x, w, s, None), x, w, s)
    wrong = w.clone()
    wrong[5] = (wrong[5].to(torch.int16) + 1).clamp(max=127).to(torch.int8)
    with pytest.raises(AssertionError):
        assert_matches_int8(out, reference_int8(x, wrong, s, None), x, wrong, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_linear_int8_matches_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    wf = (torch.randn(300, 2880, generator=gen) * 0.02).to(dtype)
    wf[7, 11] = 3.0
    q, s = w4a8moe.quantize_linear_int8(wf)
    assert q.dtype == torch.int8 and q.shape == wf.shape
    assert s.dtype == torch.float32 and s.shape == (300,)
    f = wf.float()
    want_s = f.abs().amax(1) / 127
    want_q = torch.round(f / want_s[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(s, want_s) and torch.equal(q, want_q)
    # then packed and run: the layer of the quantized weights, close to the float layer
    x = torch.randn(4, 2880)
    out = w4a8moe.linear(x, w4a8moe.pack_linear_int8(q, s))
    assert_matches_int8(out, reference_int8(x, q, s, None), x, q, s)
    ref = x.double() @ f.double().T
    keep = torch.arange(300) != 7  # the outlier's row: its weights quantize to a few steps
    err = (out.double() - ref)[:, keep].norm() / ref[:, keep].norm()
    assert err.item() < 0.03  # about 0.01-0.02: the int8 activations, per row


def test_quantize_linear_int8_edges():
    w = torch.zeros(3, 64)
    w[1, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: ties round to even
    q, s = w4a8moe.quantize_linear_int8(w)
    assert s.tolist() == [0.0, 1.0, 0.0] and q[0].abs().sum() == 0
    assert q[1, :4].tolist() == [127, 0, 2, -2]
    w[2, 9] = float("nan")
    with pytest.raises(RuntimeError, match=r"w: expected finite weights, got nan in row 2"):
        w4a8moe.quantize_linear_int8(w)
    with pytest.raises(RuntimeError, match="weight: expected dtype float32, bfloat16 or float16"):
        w4a8moe.quantize_linear_int8(torch.zeros(3, 64, dtype=torch.int8))


def test_int8_meta_and_fake_kernels():
    w, s, b = make_int8(70, 2880, torch.bfloat16, True)
    packed = w4a8moe.pack_linear_int8(w, s, bias=b)
    meta = w4a8moe.ops.pack_linear_int8(w.to("meta"), s.to("meta"), b.to("meta"))
    assert meta.shape == packed.shape and meta.dtype == torch.uint8
    q, qs = w4a8moe.ops.quantize_linear_int8(torch.empty(70, 2880, device="meta"))
    assert (q.shape, q.dtype, qs.shape, qs.dtype) == ((70, 2880), torch.int8, (70,),
                                                       torch.float32)
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover - every torch since 1.13 has it
        return
    with FakeTensorMode() as mode:
        fq, fs = w4a8moe.ops.quantize_linear_int8(mode.from_tensor(torch.randn(33, 64)))
        assert type(fq).__name__ == "FakeTensor"
        assert fq.shape == (33, 64) and fq.dtype == torch.int8 and fs.shape == (33,)
        fp = w4a8moe.ops.pack_linear_int8(mode.from_tensor(w), mode.from_tensor(s))
        out = w4a8moe.ops.linear(mode.from_tensor(torch.randn(5, 2880)), mode.from_tensor(packed),
                                 70)
        assert out.shape == (5, 70)
    assert fp.shape == w4a8moe.pack_linear_int8(w, s).shape


def test_int8_errors_name_the_argument():
    w, s, _ = make_int8(64, 256)
    with pytest.raises(RuntimeError, match=r"w: expected an input dimension K that is a multiple "
                       r"of 32 for int8 weights, got K = 100"):
        w4a8moe.pack_linear_int8(w[:, :100], s)
    with pytest.raises(RuntimeError, match=r"weight: expected dtype int8 \(int8 weights\)"):
        w4a8moe.pack_linear_int8(w.to(torch.uint8), s)
    with pytest.raises(RuntimeError, match=r"w_scale: expected shape \[1, 64\]"):
        w4a8moe.pack_linear_int8(w, s[:32])
    with pytest.raises(RuntimeError, match=r"w_scale: expected dtype"):
        w4a8moe.pack_linear_int8(w, s.to(torch.int8))
    packed = w4a8moe.pack_linear_int8(w, s)
    with pytest.raises(RuntimeError, match="x: expected 256 columns"):
        w4a8moe.linear(torch.randn(2, 512), packed)
    # the MoE op refuses it (H = I = 64: the shapes of a w2)
    w13, _ = w4a8moe.ops.convert_to_w4a8_int8_moe_format(
        torch.zeros(2, 128, 64, dtype=torch.int8), torch.zeros(2, 64, 64, dtype=torch.int8),
        torch.ones(2, 128), torch.ones(2, 64), -1)
    w2, s2, _ = make_int8(64, 64)
    x = torch.randn(3, 64)
    ids = torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="w2_packed: expected an MoE layer's int4 or mxfp4 "
                       "weights, got int8 weights"):
        w4a8moe.ops.dynamic_4bit_int_moe(x, ids, torch.ones(3, 1), w13,
                                         w4a8moe.pack_linear_int8(w2, s2), 64, 64, -1, False, 2)


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck: torch 2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_int8(dtype):
    w, s, b = make_int8(96, 128, dtype, True)
    packed = w4a8moe.pack_linear_int8(w, s, bias=b)
    torch.library.opcheck(torch.ops.w4a8moe.linear.default,
                          (torch.randn(5, 128).to(dtype), packed, 96))
    torch.library.opcheck(torch.ops.w4a8moe.pack_linear_int8.default, (w, s, b))
    torch.library.opcheck(torch.ops.w4a8moe.quantize_linear_int8.default,
                          (torch.randn(40, 96).to(dtype),))
