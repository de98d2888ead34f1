"""The dense linear ops (torch.ops.w4a8moe.pack_linear / linear, w4a8moe.pack_linear / linear)
against a plain-torch reference of the contract: each row of x quantized per row to int8
(w4a8moe.reference.quant_row), exact integer sums per weight group, the group scales and the
bias in float64. Tolerance: 1e-6 * sqrt(K) of the row's largest output (f32 sums), plus the
rounding of the output to bfloat16 / float16. Then shapes, the meta kernels, the errors, and
(torch 2) torch.library.opcheck.
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
