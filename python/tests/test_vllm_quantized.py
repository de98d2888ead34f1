"""w4a8moe.vllm's packing of the engine's quantized MoE layers' tensors (GPTQ, AWQ, MXFP4) as
its weight loaders leave them. The tensors are packed here, in the engine's layouts, by code of
this test written from AutoGPTQ's and AutoAWQ's pack(), independently of the module's
unpacking; the layers then match the exact reference over the file's integers (act-order: the
float layer of the weights dequantized by g_idx)."""

import math

import pytest
import torch

import w4a8moe
from ecosystem import float_moe, relative_rms
from moe_data import assert_matches, make_inputs
from w4a8moe.vllm import pack_awq_moe, pack_gptq_moe, pack_mxfp4_moe

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack(): bits 4i hold output 8w + order[i]


def to_int32(words):
    """int64 words of 32 bits -> int32 (two's complement)."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_inputs(q):
    """GPTQ qweight: q [E, N, K] unsigned -> [E, K/8, N], input 8i + j in bits 4j."""
    e, n, k = q.shape
    q = q.long().transpose(1, 2).reshape(e, k // 8, 8, n)
    return to_int32(sum(q[:, :, j] << (4 * j) for j in range(8)))


def pack_outputs(v, awq):
    """[E, R, N] unsigned -> [E, R, N/8], output 8w + order[i] in bits 4i (order: AWQ's or
    0..7)."""
    e, r, n = v.shape
    v = v.long().reshape(e, r, n // 8, 8)
    order = AWQ_ORDER if awq else range(8)
    return to_int32(sum(v[..., o] << (4 * i) for i, o in enumerate(order)))


def layer(experts, inter, hidden, group, gen, act_order=False):
    """Unsigned values q [E, N, K], zeros [E, N, G] in [1, 15], scales [E, N, G] and g_idx [E, K]
    (act-order: g inputs per group, scattered) for w13 and w2."""
    out = {}
    for name, rows, cols, gain in (("w13", 2 * inter, hidden, 1.5), ("w2", hidden, inter, 1.0)):
        groups = 1 if group == -1 else cols // group
        g = cols if group == -1 else group
        if act_order:
            g_idx = torch.stack([torch.randperm(cols, generator=gen) // g for _ in range(experts)])
        else:
            g_idx = (torch.arange(cols) // g).expand(experts, cols)
        out[name] = dict(
            q=torch.randint(0, 16, (experts, rows, cols), generator=gen),
            z=torch.randint(1, 16, (experts, rows, groups), generator=gen),
            s=((0.5 + torch.rand(experts, rows, groups, generator=gen)) * gain
               / (6.0 * math.sqrt(cols))).to(torch.float16),
            g_idx=g_idx.to(torch.int32))
    return out


def dequantized(t, symmetric):
    """[E, N, K] float: (q - zero) * scale of input k's group g_idx[k]."""
    idx = t["g_idx"].long().unsqueeze(1).expand(-1, t["q"].shape[1], -1)
    zero = torch.full_like(t["q"], 8) if symmetric else torch.gather(t["z"], 2, idx)
    return (t["q"] - zero).double() * torch.gather(t["s"].double(), 2, idx)


@pytest.mark.parametrize("group,sym", [(32, False), (64, True), (-1, False)])
def test_gptq_layer_matches_the_reference(group, sym):
    gen = torch.Generator().manual_seed(31)
    E, I, H = 4, 64, 128
    w = layer(E, I, H, group, gen)
    zeros = {n: w[n]["z"] - 1 for n in w}  # the "gptq" format stores zero - 1
    p13, p2 = pack_gptq_moe(
        pack_inputs(w["w13"]["q"]), pack_inputs(w["w2"]["q"]),
        w["w13"]["s"].transpose(1, 2).contiguous(), w["w2"]["s"].transpose(1, 2).contiguous(),
        group, w13_qzeros=pack_outputs(zeros["w13"].transpose(1, 2), False),
        w2_qzeros=pack_outputs(zeros["w2"].transpose(1, 2), False),
        w13_g_idx=w["w13"]["g_idx"], w2_g_idx=w["w2"]["g_idx"], sym=sym)
    info = w4a8moe.packed_info(p13)
    assert info.weight_format == ("int4_symmetric" if sym else "int4_zero_point")
    x, ids, wts = make_inputs(12, H, E, 2, 8)
    out = w4a8moe.moe(x, ids, wts, p13, p2)
    meaning = {n: (w[n]["q"] - (8 if sym else w[n]["z"].repeat_interleave(
        H if group == -1 and n == "w13" else I if group == -1 else group, dim=2))).to(torch.int8)
        for n in w}
    s = {n: w[n]["s"].float()[..., 0] if group == -1 else w[n]["s"].float() for n in w}
    ref = w4a8moe.reference_moe(x, ids, wts, meaning["w13"], meaning["w2"], s["w13"], s["w2"],
                                group)
    assert_matches(out, ref, f"GPTQ g{group} sym={sym}")


def test_gptq_act_order_runs_as_g_idx_says():
    gen = torch.Generator().manual_seed(32)
    E, I, H, g = 4, 64, 128, 32
    w = layer(E, I, H, g, gen, act_order=True)
    p13, p2 = pack_gptq_moe(
        pack_inputs(w["w13"]["q"]), pack_inputs(w["w2"]["q"]),
        w["w13"]["s"].transpose(1, 2).contiguous(), w["w2"]["s"].transpose(1, 2).contiguous(),
        g, w13_qzeros=pack_outputs(w["w13"]["z"].transpose(1, 2) - 1, False),
        w2_qzeros=pack_outputs(w["w2"]["z"].transpose(1, 2) - 1, False),
        w13_g_idx=w["w13"]["g_idx"], w2_g_idx=w["w2"]["g_idx"], sym=False)
    assert w4a8moe.packed_info(p13).has_input_order
    x, ids, wts = make_inputs(16, H, E, 2, 9)
    out = w4a8moe.moe(x, ids, wts, p13, p2)
    w13, w2 = dequantized(w["w13"], False), dequantized(w["w2"], False)
    ref = float_moe(x, ids, wts, w13[:, :I], w13[:, I:], w2)
    assert 0.1 < ref.pow(2).mean().sqrt().item() < 10
    assert relative_rms(out, ref) < 3e-2
    for t in w.values():  # read as if g_idx were k / g: far off
        t["g_idx"] = (torch.arange(t["q"].shape[2]) // g).expand_as(t["g_idx"]).to(torch.int32)
    w13, w2 = dequantized(w["w13"], False), dequantized(w["w2"], False)
    assert relative_rms(out, float_moe(x, ids, wts, w13[:, :I], w13[:, I:], w2)) > 0.3


def test_awq_layer_matches_the_reference():
    gen = torch.Generator().manual_seed(33)
    E, I, H, g = 4, 64, 128, 32
    w = layer(E, I, H, g, gen)
    p13, p2 = pack_awq_moe(
        pack_outputs(w["w13"]["q"].transpose(1, 2), True),
        pack_outputs(w["w2"]["q"].transpose(1, 2), True),
        w["w13"]["s"].transpose(1, 2).contiguous(), w["w2"]["s"].transpose(1, 2).contiguous(),
        pack_outputs(w["w13"]["z"].transpose(1, 2), True),
        pack_outputs(w["w2"]["z"].transpose(1, 2), True), g)
    x, ids, wts = make_inputs(12, H, E, 2, 10)
    out = w4a8moe.moe(x, ids, wts, p13, p2)
    meaning = {n: (w[n]["q"] - w[n]["z"].repeat_interleave(g, dim=2)).to(torch.int8) for n in w}
    ref = w4a8moe.reference_moe(x, ids, wts, meaning["w13"], meaning["w2"],
                                w["w13"]["s"].float(), w["w2"]["s"].float(), g)
    assert_matches(out, ref, "AWQ g32")


def test_mxfp4_is_packed_as_given():
    gen = torch.Generator().manual_seed(34)
    E, I, H = 2, 64, 64
    c13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=gen, dtype=torch.uint8)
    c2 = torch.randint(0, 256, (E, H, I // 2), generator=gen, dtype=torch.uint8)
    e13 = torch.randint(120, 124, (E, 2 * I, H // 32), generator=gen, dtype=torch.uint8)
    e2 = torch.randint(120, 124, (E, H, I // 32), generator=gen, dtype=torch.uint8)
    p13, p2 = pack_mxfp4_moe(c13, c2, e13, e2)
    want = w4a8moe.pack(c13, c2, e13, e2, 32, gate_up_layout="interleaved")
    assert torch.equal(p13, want[0]) and torch.equal(p2, want[1])
    assert w4a8moe.packed_info(p13).weight_format == "mxfp4"


def test_refusals_name_the_tensor():
    gen = torch.Generator().manual_seed(35)
    w = layer(2, 64, 64, 32, gen)
    qw13, qw2 = pack_inputs(w["w13"]["q"]), pack_inputs(w["w2"]["q"])
    s13, s2 = (w[n]["s"].transpose(1, 2).contiguous() for n in ("w13", "w2"))
    with pytest.raises(RuntimeError, match=r"w2.weight of each expert: expected dtype i32, "
                                           r"got i64"):
        pack_gptq_moe(qw13, qw2.to(torch.int64), s13, s2, 32)
    with pytest.raises(RuntimeError, match=r"w2.scale of each expert: expected shape \[2, 64\], "
                                           r"got \[1, 64\]"):
        pack_gptq_moe(qw13, qw2, s13, s2[:, :1], 32)
    bad = w["w13"]["g_idx"].clone()
    bad[0, 40:42] = 0  # group 0 gets two inputs of group 1
    with pytest.raises(RuntimeError, match=r"w13.g_idx of each expert puts 34 inputs in group 0, "
                                           r"expected the group size 32 \(expert 0\)"):
        pack_gptq_moe(qw13, qw2, s13, s2, 32, w13_g_idx=bad)
    with pytest.raises(ValueError, match=r"w13_qzeros, w2_qzeros: expected the zero points"):
        pack_gptq_moe(qw13, qw2, s13, s2, 32, sym=False)
    zeros = pack_outputs(torch.full((2, 2, 128), 15), False)  # "gptq" stores zero - 1: 16
    with pytest.raises(RuntimeError, match=r"w13.zero_point of each expert stores 15 at "
                                           r"\[0, 0, 0\]: zero 16"):
        pack_gptq_moe(qw13, qw2, s13, s2, 32, w13_qzeros=zeros,
                      w2_qzeros=pack_outputs(torch.full((2, 2, 64), 7), False), sym=False)
