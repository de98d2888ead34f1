"""Bad input raises RuntimeError carrying the library's sentence; is_supported_config never
raises."""

import pytest
import torch

import w4a8moe
from moe_data import make_inputs, make_weights

E, I, H, K, G = 8, 128, 256, 2, 64
op = torch.ops.w4a8moe.dynamic_4bit_int_moe


@pytest.fixture(scope="module")
def case():
    weights = make_weights(E, I, H, G, 21)
    x, ids, wts = make_inputs(6, H, E, K, 21)
    return weights, weights.pack(), x, ids, wts


def test_expert_ids_out_of_range(case):
    _, (w13, w2), x, ids, wts = case
    bad = ids.clone()
    bad[3, 1] = E
    with pytest.raises(RuntimeError, match=r"topk_ids: expected expert ids in \[0, 8\), got 8 at "
                                           r"token 3, slot 1"):
        op(x, bad, wts, w13, w2, H, I, G, False, 2)
    bad[3, 1] = -1
    with pytest.raises(RuntimeError, match=r"got -1 at token 3, slot 1"):
        op(x, bad.to(torch.int32), wts, w13, w2, H, I, G, False, 2)


def test_unknown_activation(case):
    _, (w13, w2), x, ids, wts = case
    message = r"activation: expected a code in \[0, 4\] .*got 7"
    with pytest.raises(RuntimeError, match=message):
        op(x, ids, wts, w13, w2, H, I, G, False, 7)
    with pytest.raises(RuntimeError, match=message):
        w4a8moe.moe(x, ids, wts, w13, w2, activation=7)
    with pytest.raises(ValueError, match="activation: expected one of swiglustep, .*got 'relu'"):
        w4a8moe.moe(x, ids, wts, w13, w2, activation="relu")


@pytest.mark.parametrize("args,message", [
    ((512, I, G), r"hidden_size: expected 256 \(the hidden size of w13_packed\), got 512"),
    ((H, 256, G), r"intermediate_size: expected 128 \(half the rows of w13_packed\), got 256"),
    ((H, I, 128), r"group_size: expected 64 \(the group size of w13_packed\), got 128"),
    ((H, I, -1), r"group_size: expected 64 \(the group size of w13_packed\), got -1"),
])
def test_sizes_must_agree_with_the_packed_buffers(case, args, message):
    _, (w13, w2), x, ids, wts = case
    with pytest.raises(RuntimeError, match=message):
        op(x, ids, wts, w13, w2, *args, False, 2)


def test_mismatched_tensors(case):
    _, (w13, w2), x, ids, wts = case
    with pytest.raises(RuntimeError, match=r"x: expected 256 columns \(hidden_size\), got shape"):
        op(x[:, :128], ids, wts, w13, w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match=r"topk_ids: expected shape \[6, K\]"):
        op(x, ids[:4], wts[:4], w13, w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match=r"topk_weights: expected shape \[6, 2\], got \[6, 1\]"):
        op(x, ids, wts[:, :1], w13, w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="w13_packed: expected weights packed as w13"):
        op(x, ids, wts, w2, w13, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="x: expected dtype f32, bf16 or f16, got i64"):
        op(x.long(), ids, wts, w13, w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="topk_ids: expected dtype int32 or int64, got Float"):
        op(x, ids.float(), wts, w13, w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="w13_packed: expected a uint8 tensor"):
        op(x, ids, wts, w13.view(torch.int8), w2, H, I, G, False, 2)


def test_other_experts_count(case):
    weights, (w13, _), x, ids, wts = case
    other = make_weights(4, I, H, G, 1).pack()
    with pytest.raises(RuntimeError, match=r"w2_packed: expected 8 experts of \[256, 128\]"):
        op(x, ids, wts, w13, other[1], H, I, G, False, 2)


def test_damaged_packed_buffers(case):
    _, (w13, w2), x, ids, wts = case
    corrupted = w13.clone()
    corrupted[20] ^= 1  # a header field
    with pytest.raises(RuntimeError, match=r"w13_packed: the packed header is corrupted"):
        op(x, ids, wts, corrupted, w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match=r"w2_packed: expected \d+ bytes .* \(truncated"):
        op(x, ids, wts, w13, w2[:-64], H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="not a w4a8moe packed buffer"):
        op(x, ids, wts, torch.zeros_like(w13), w2, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="packed: not a w4a8moe packed buffer"):
        w4a8moe.packed_info(torch.zeros(256, dtype=torch.uint8))


def test_bad_weights_at_pack_time():
    w = make_weights(2, 64, 128, 32, 2)
    w13 = w.w13.clone()
    w13[1, 5, 9] = 9
    with pytest.raises(RuntimeError, match=r"w13: expected int4 values in \[-8, 7\], got 9 at "
                                           r"\[1, 5, 9\]"):
        w4a8moe.pack(w13, w.w2, w.w13_scale, w.w2_scale, 32)
    with pytest.raises(RuntimeError, match="group_size: expected -1 or a multiple of 32"):
        w4a8moe.pack(w.w13, w.w2, w.w13_scale, w.w2_scale, 48)
    with pytest.raises(RuntimeError, match=r"w13_scale: expected shape \[2, 128, 4\]"):
        w4a8moe.pack(w.w13, w.w2, w.w13_scale[:, :, :2], w.w2_scale, 32)
    with pytest.raises(RuntimeError, match=r"w2_weight: expected 2 experts of \[128, 64\]"):
        w4a8moe.pack(w.w13, w.w2[:, :, :32], w.w13_scale, w.w2_scale, 32)
    with pytest.raises(RuntimeError, match="gate_up_layout: expected 'halves' or 'interleaved'"):
        w4a8moe.pack(w.w13, w.w2, w.w13_scale, w.w2_scale, 32, gate_up_layout="zigzag")
    with pytest.raises(RuntimeError, match="w13_weight: expected dtype int8"):
        w4a8moe.pack_with_original_op(w.w13.float(), w.w2, w.w13_scale, w.w2_scale, 32)


def test_is_supported_config():
    assert w4a8moe.is_supported_config(2048, 768, 128, 8, 128, "silu") == (True, None)
    assert w4a8moe.is_supported_config(2880, 2880, 32, 4, -1, 1, torch.float32) == (True, None)
    ok, why = w4a8moe.is_supported_config(2048, 768, 128, 8, 48)
    assert not ok and "group size 48 is not supported" in why
    ok, why = w4a8moe.is_supported_config(2048, 768, 128, 8, 96)
    assert not ok and "must divide both hidden (2048) and intermediate (768)" in why
    ok, why = w4a8moe.is_supported_config(2048, 768, 128, 8, 128, 7)
    assert not ok and "activation code 7 is unknown" in why
    ok, why = w4a8moe.is_supported_config(2048, 768, 128, 8, 128, "relu")
    assert not ok and "relu" in why
    ok, why = w4a8moe.is_supported_config(2048, 768, 128, 8, 128, dtype=torch.int8)
    assert not ok and "use float32, bfloat16 or float16" in why
    ok, why = w4a8moe.is_supported_config(0, 768, 128, 8)
    assert not ok and "must all be positive" in why


def test_a_packed_buffer_rewritten_in_place_is_read_again():
    """The op remembers the packed headers it has read: a buffer that now holds other experts
    (the same bytes at the same address, other shapes) is held against its new header."""
    one = make_weights(1, 64, 64, 32, 5).pack()  # one expert, I 64
    two = make_weights(2, 32, 64, 32, 6).pack()  # two experts, I 32: as many w13 bytes
    if one[0].numel() != two[0].numel():
        pytest.skip("this kernel set's layout pads the two w13 buffers to different sizes")
    x, ids, wts = make_inputs(3, 64, 1, 1, 5)
    op(x, ids, wts, one[0], one[1], 64, 64, 32, False, 2)
    rewritten = one[0]
    rewritten.copy_(two[0])
    x, ids, wts = make_inputs(3, 64, 2, 1, 6)
    with pytest.raises(RuntimeError, match=r"intermediate_size: expected 32 \(half the rows"):
        op(x, ids, wts, rewritten, two[1], 64, 64, 32, False, 2)
    out = op(x, ids, wts, rewritten, two[1], 64, 32, 32, False, 2)
    assert torch.equal(out, op(x, ids, wts, two[0], two[1], 64, 32, 32, False, 2))
