"""GGUF files written and quantized by the gguf package (llama.cpp's own Python code), read by
the library's GGUF reader.

- Every type the loader dequantizes: the reader's values equal gguf's own dequantization, bit
  for bit. gguf quantizes F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 itself; it has no
  quantizer for the K-quants (Q4_K, Q5_K, Q6_K: NotImplementedError), so those tensors hold
  random blocks (any bytes are a valid block once the f16 scales are finite), which both sides
  then dequantize.
- A Qwen3-MoE layer (router F32, gate and up Q4_0, down Q8_0, all quantized by gguf) run by
  `w4a8moe layer`: routing as the model's, Q4_0 read exactly (against the exact reference over
  the int4 values decoded here from the file's blocks), and within the int8-activation error of
  the float experts on gguf's dequantized weights.
- The same layer with every expert tensor MXFP4 (as gpt-oss GGUFs hold them), quantized by gguf,
  run with `--exact`: the output is the exact reference's over gguf's own dequantization of the
  blocks (the doubled e2m1 integers and the scales 2^(e - 128)).
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (PyTorch 2 venv) is not installed")
pytest.importorskip("safetensors")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

import w4a8moe  # noqa: E402
from ecosystem import float_moe, program, relative_rms, run, run_layer  # noqa: E402
from moe_data import assert_matches  # noqa: E402

# Types gguf quantizes itself, and the K-quants it only dequantizes.
QUANTIZED_BY_GGUF = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4]
RANDOM_BLOCKS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def random_k_blocks(qtype, rows, cols, rng):
    """Random bytes in the type's layout, with each block's f16 scale fields finite and small."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    halves = rng.uniform(-0.05, 0.05, size=(rows, cols // block_elems, 2)).astype(np.float16)
    if qtype == Q.Q6_K:  # {ql[128], qh[64], scales[16], half d}: d is last
        blocks[..., -2:] = halves[..., :1].view(np.uint8)
    else:  # Q4_K, Q5_K: {half d, half dmin, ...}
        blocks[..., :4] = halves.view(np.uint8).reshape(rows, cols // block_elems, 4)
    return blocks.reshape(rows, -1)


def write_gguf(path, arch, tensors, kv=()):
    """tensors: name -> (numpy array, raw ggml type or None). kv: (method name, value) pairs."""
    writer = gguf.GGUFWriter(str(path), arch)
    for method, value in kv:
        getattr(writer, method)(value)
    for name, (data, raw_type) in tensors.items():
        if raw_type is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reader_dequantizes_like_gguf(tmp_path):
    rng = np.random.default_rng(5)
    tensors, expected = {}, {}
    for i, qtype in enumerate(QUANTIZED_BY_GGUF + RANDOM_BLOCKS):
        shape = (3, 8, 512) if i % 2 else (16, 256)  # 3-D as expert tensors, 2-D as others
        rows = int(np.prod(shape[:-1]))
        if qtype in RANDOM_BLOCKS:
            data = random_k_blocks(qtype, rows, shape[-1], rng).reshape(*shape[:-1], -1)
        else:
            values = (rng.standard_normal(shape) * rng.uniform(0.1, 3.0, size=shape[:-1] + (1,)))
            values[..., :7] = [0.0, -0.0, 1e-3, -8.0, 7.5, 1e-8, -1e4]  # zeros, tiny, extremes
            data = quants.quantize(values.astype(np.float32), qtype)
        name = f"t{i}.{qtype.name}"
        if qtype == Q.F32:
            tensors[name] = (data, None)
        elif qtype == Q.F16:
            tensors[name] = (data, Q.F16)
        else:
            tensors[name] = (data, qtype)
        expected[name] = quants.dequantize(data, qtype).astype(np.float32)
    path = tmp_path / "types.gguf"
    write_gguf(path, "llama", tensors)

    out = tmp_path / "dequantized.safetensors"
    run([program("w4a8moe_gguf_dequant", "W4A8MOE_GGUF_DEQUANT"), str(path), str(out)])
    from safetensors.numpy import load_file

    got = load_file(str(out))
    assert sorted(got) == sorted(expected), "the reader skipped a tensor"
    for name, want in expected.items():
        have = got[name]
        assert have.shape == want.shape, (name, have.shape, want.shape)
        assert np.unique(want).size > 8, f"{name}: degenerate test data"
        same = have.view(np.uint32) == want.view(np.uint32)
        if not same.all():
            where = np.argwhere(~same)[0]
            raise AssertionError(
                f"{name}: {int((~same).sum())} values differ from gguf's dequantization, first "
                f"at {tuple(where)}: ours {have[tuple(where)]!r}, gguf's {want[tuple(where)]!r}")


def test_a_changed_byte_is_seen(tmp_path):
    """The comparison above can fail: one byte of a Q8_0 block changed after gguf wrote the
    file gives a different value there."""
    values = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    data = quants.quantize(values, Q.Q8_0)
    path = tmp_path / "one.gguf"
    write_gguf(path, "llama", {"w": (data, Q.Q8_0)})
    start = gguf.GGUFReader(str(path)).tensors[0].data_offset  # gguf's reader says where
    raw = bytearray(path.read_bytes())
    raw[start + data.nbytes - 1] ^= 0x01  # the last quant of the last block
    path.write_bytes(bytes(raw))
    out = tmp_path / "one.safetensors"
    run([program("w4a8moe_gguf_dequant", "W4A8MOE_GGUF_DEQUANT"), str(path), str(out)])
    from safetensors.numpy import load_file

    have = load_file(str(out))["w"]
    want = quants.dequantize(data, Q.Q8_0)
    assert (have != want).sum() == 1 and have[-1, -1] != want[-1, -1]


def q4_0_values_and_scales(blocks, rows_shape, cols):
    """Q4_0 bytes -> int4 values [..., cols] (int8) and f16 scales [..., cols/32], decoded here
    from the block layout (half d; 16 bytes: element j low nibble, j + 16 high nibble; q - 8)."""
    b = blocks.reshape(-1, cols // 32, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0]
    qs = b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8
    return (torch.from_numpy(q.reshape(*rows_shape, cols)),
            torch.from_numpy(d.reshape(*rows_shape, cols // 32).copy()))


def write_qwen3moe_layer(path, router, q_gate, q_up, down, K, I):
    """A one-layer qwen3moe file: the f32 router [E, H], gate and up in Q4_0, down = (its blocks,
    its type), top-k K, expert intermediate size I."""
    E, H = router.shape
    write_gguf(path, "qwen3moe", {
        "blk.0.ffn_gate_inp.weight": (router, None),
        "blk.0.ffn_gate_exps.weight": (q_gate, Q.Q4_0),
        "blk.0.ffn_up_exps.weight": (q_up, Q.Q4_0),
        "blk.0.ffn_down_exps.weight": down,
    }, kv=[("add_block_count", 1), ("add_expert_count", E), ("add_expert_used_count", K),
           ("add_embedding_length", H), ("add_expert_feed_forward_length", I)])


def random_moe_layer(rng, E, H, I):
    """Float32 router [E, H], gate and up [E, I, H], down [E, H, I], outputs of order one."""
    router = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
    gate = (rng.standard_normal((E, I, H)) * 1.5 / np.sqrt(H)).astype(np.float32)
    up = (rng.standard_normal((E, I, H)) * 1.5 / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    return router, gate, up, down


def test_qwen3moe_layer_written_by_gguf(tmp_path):
    E, K, H, I, T = 8, 2, 256, 128, 24
    rng = np.random.default_rng(11)
    router, gate, up, down = random_moe_layer(rng, E, H, I)
    q_gate, q_up = quants.quantize(gate, Q.Q4_0), quants.quantize(up, Q.Q4_0)
    q_down = quants.quantize(down, Q.Q8_0)
    path = tmp_path / "qwen3moe.gguf"
    write_qwen3moe_layer(path, router, q_gate, q_up, (q_down, Q.Q8_0), K, I)

    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
    out, ids, wts, stdout = run_layer(path, x, tmp_path)
    assert "Q4_0 -> int4 exactly" in stdout, stdout

    # Routing: Qwen3-MoE's softmax, top-k, renormalised, on the file's router.
    probs = torch.softmax(x.double() @ torch.from_numpy(router).double().T, dim=-1)
    want_w, want_ids = torch.topk(probs, K, dim=-1)
    want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, want_ids), "routing differs from softmax + top-k"
    torch.testing.assert_close(wts.double(), want_w, rtol=1e-5, atol=1e-6)

    # Against the float experts on gguf's own dequantized weights. The loader converts Q8_0 to
    # int4 (requantized, 6-9% relative RMS of the weights, as it prints): with the int8
    # activations the output is off by about 9% here. The exact check is the all-Q4_0 file below.
    dq = {n: torch.from_numpy(quants.dequantize(q, t).astype(np.float32))
          for n, q, t in (("gate", q_gate, Q.Q4_0), ("up", q_up, Q.Q4_0), ("down", q_down, Q.Q8_0))}
    ref = float_moe(x, ids, wts, dq["gate"], dq["up"], dq["down"])
    err = relative_rms(out, ref)
    assert err < 0.15, f"relative RMS error {err:.3g} against the float experts"
    assert "Q8_0 -> int4 g32 (converted)" in stdout, stdout
    assert relative_rms(torch.zeros_like(out), ref) > 0.5

    # All-Q4_0 layer with --exact: the file's int4 values and f16 scales, bit for bit, so the
    # output is the exact reference's (same quantization, double accumulation).
    q_down4 = quants.quantize(down, Q.Q4_0)
    path4 = tmp_path / "exact.gguf"
    write_qwen3moe_layer(path4, router, q_gate, q_up, (q_down4, Q.Q4_0), K, I)
    out4, ids4, wts4, _ = run_layer(path4, x, tmp_path, "--exact")
    g, gs = q4_0_values_and_scales(q_gate, (E, I), H)
    u, us = q4_0_values_and_scales(q_up, (E, I), H)
    d, ds = q4_0_values_and_scales(q_down4, (E, H), I)
    exact = w4a8moe.reference_moe(x, ids4, wts4, torch.cat([g, u], 1), d, torch.cat([gs, us], 1),
                                  ds, 32)
    assert_matches(out4, exact, "all-Q4_0 layer against the exact reference")


def mxfp4_values_and_scales(q, rows_shape, cols):
    """gguf's MXFP4 blocks -> (2 * e2m1 as int8 [..., cols], scales 2^(e - 128) [..., cols/32]):
    the values from gguf's own dequantization, divided by the scale whose exponent is each
    block's first byte (ggml's block: u8 e, then 16 bytes of codes)."""
    e = q.reshape(-1, cols // 32, 17)[..., 0].astype(np.float64)
    scales = np.exp2(e - 128)
    values = quants.dequantize(q, Q.MXFP4).astype(np.float64).reshape(-1, cols // 32, 32)
    doubled = values / scales[..., None]
    assert np.array_equal(doubled, np.round(doubled)) and np.abs(doubled).max() <= 12
    return (torch.from_numpy(doubled.astype(np.int8).reshape(*rows_shape, cols)),
            torch.from_numpy(scales.astype(np.float32).reshape(*rows_shape, cols // 32)))


def test_mxfp4_layer_written_by_gguf_runs_exactly(tmp_path):
    # gpt-oss GGUFs hold their experts in MXFP4: gguf quantizes them here, `layer --exact` takes
    # them as mxfp4, and the output is the exact reference's over gguf's own decoding of them.
    E, K, H, I, T = 8, 2, 256, 128, 24
    rng = np.random.default_rng(12)
    router, gate, up, down = random_moe_layer(rng, E, H, I)
    q = {n: quants.quantize(w, Q.MXFP4) for n, w in (("gate", gate), ("up", up), ("down", down))}
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, "qwen3moe", {
        "blk.0.ffn_gate_inp.weight": (router, None),
        "blk.0.ffn_gate_exps.weight": (q["gate"], Q.MXFP4),
        "blk.0.ffn_up_exps.weight": (q["up"], Q.MXFP4),
        "blk.0.ffn_down_exps.weight": (q["down"], Q.MXFP4),
    }, kv=[("add_block_count", 1), ("add_expert_count", E), ("add_expert_used_count", K),
           ("add_embedding_length", H), ("add_expert_feed_forward_length", I)])
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
    out, ids, wts, stdout = run_layer(path, x, tmp_path, "--exact")
    assert "MXFP4 -> mxfp4 exactly" in stdout, stdout
    g, gs = mxfp4_values_and_scales(q["gate"], (E, I), H)
    u, us = mxfp4_values_and_scales(q["up"], (E, I), H)
    d, ds = mxfp4_values_and_scales(q["down"], (E, H), I)
    exact = w4a8moe.reference_moe(x, ids, wts, torch.cat([g, u], 1), d, torch.cat([gs, us], 1),
                                  ds, 32)
    assert_matches(out, exact, "all-MXFP4 layer against the exact reference")
