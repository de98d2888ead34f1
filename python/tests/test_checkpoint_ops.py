"""The checkpoint-layout packing ops (w4a8moe.pack_checkpoint_moe / pack_checkpoint_linear):
compressed-tensors and GPTQ tensors written here from logical int4 values by this test's own
packing (compressed-tensors' pack_to_int32 order: input 8w + i in bits 4i, value + 8), packed,
and compared byte for byte with w4a8moe.pack / pack_linear of the logical values; errors name
the tensor; on torch 2 the ops pass opcheck and run under FakeTensorMode (a data-dependent
size: the input order is kept only for act-order)."""

import pytest
import torch

import w4a8moe


def words_along_last(u):
    """[..., R, C] unsigned 4-bit -> int32 [..., R, C/8], element 8w + i in bits 4i."""
    u = u.long().reshape(*u.shape[:-1], u.shape[-1] // 8, 8)
    word = sum(u[..., i] << (4 * i) for i in range(8))
    return ((word + 2**31) % 2**32 - 2**31).to(torch.int32)


def layer(gen, experts=3, hidden=64, inter=32, group=32, zeros=True):
    out = {}
    for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        groups = cols // group
        out[name] = dict(
            q=torch.randint(0, 16, (experts, rows, cols), generator=gen),
            z=torch.randint(0, 16, (experts, rows, groups), generator=gen) if zeros else None,
            s=torch.rand(experts, rows, groups, generator=gen) / 32 + 1e-3)
    return out


def ct_tensors(t):
    """compressed-tensors: weight_packed [E, N, K/8], scale [E, N, G], zero point [E, N/8, G]."""
    zero = None
    if t["z"] is not None:
        zero = words_along_last(t["z"].transpose(1, 2)).transpose(1, 2).contiguous()
    return words_along_last(t["q"]), t["s"], zero


@pytest.mark.parametrize("zeros", [False, True])
def test_compressed_tensors_layer_packs_like_pack(zeros):
    gen = torch.Generator().manual_seed(3)
    w = layer(gen, zeros=zeros)
    (q13, s13, z13), (q2, s2, z2) = ct_tensors(w["w13"]), ct_tensors(w["w2"])
    got = w4a8moe.pack_checkpoint_moe("compressed-tensors", q13, s13, q2, s2, 32,
                                      w13_zero_point=z13, w2_zero_point=z2)
    logical = {n: (w[n]["q"] - 8).to(torch.int8) for n in w}
    zp = {n: None if w[n]["z"] is None else (w[n]["z"] - 8).to(torch.int8) for n in w}
    want = w4a8moe.pack(logical["w13"], logical["w2"], w["w13"]["s"], w["w2"]["s"], 32,
                        w13_zero_point=zp["w13"], w2_zero_point=zp["w2"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    info = w4a8moe.packed_info(got[0])
    assert info.weight_format == ("int4_zero_point" if zeros else "int4_symmetric")


def test_gptq_dense_layer_packs_like_pack_linear():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (48, 64), generator=gen)  # [N, K]
    s = torch.rand(48, 2, generator=gen) / 16
    qweight = words_along_last(q).t().contiguous()  # GPTQ [K/8, N]: the words along the inputs
    got = w4a8moe.pack_checkpoint_linear("gptq_v2", qweight, s.t().contiguous(), 32)
    want = w4a8moe.pack_linear((q - 8).to(torch.int8), s, 32)
    assert torch.equal(got, want)


def test_errors_name_the_tensor():
    gen = torch.Generator().manual_seed(5)
    w = layer(gen)
    (q13, s13, z13), (q2, s2, z2) = ct_tensors(w["w13"]), ct_tensors(w["w2"])
    with pytest.raises(RuntimeError, match=r"w2.scale of each expert: expected shape \[64, 1\], "
                                           r"got \[64, 2\]"):
        w4a8moe.pack_checkpoint_moe("compressed-tensors", q13, s13, q2,
                                    s2.expand(-1, -1, 2).contiguous(), 32)
    with pytest.raises(RuntimeError, match=r"format: expected gptq, gptq_v2, awq, "
                                           r"compressed-tensors or mxfp4, got 'gptq3'"):
        w4a8moe.pack_checkpoint_moe("gptq3", q13, s13, q2, s2, 32)
    with pytest.raises(RuntimeError, match=r"w.g_idx: expected the inputs in order"):
        g_idx = torch.arange(64, dtype=torch.int32).flip(0) // 32
        w4a8moe.pack_checkpoint_linear("compressed-tensors", q13[0], s13[0], 32, g_idx=g_idx)


torch2 = pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch 2's opcheck")


@torch2
def test_ops_pass_opcheck_and_fake_tensors():
    gen = torch.Generator().manual_seed(6)
    w = layer(gen)
    (q13, s13, z13), (q2, s2, z2) = ct_tensors(w["w13"]), ct_tensors(w["w2"])
    args = ("compressed-tensors", q13, s13, q2, s2, 32, z13, z2)
    torch.library.opcheck(torch.ops.w4a8moe.pack_checkpoint_moe.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    torch.library.opcheck(torch.ops.w4a8moe.pack_checkpoint_linear.default,
                          ("compressed-tensors", q13[0], s13[0], 32),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = [mode.from_tensor(t) for t in (q13, s13, q2, s2)]
        p13, p2 = w4a8moe.pack_checkpoint_moe("compressed-tensors", *fake[:2], *fake[2:], 32)
        assert p13.dtype == torch.uint8 and p13.dim() == 1 and p2.dim() == 1
