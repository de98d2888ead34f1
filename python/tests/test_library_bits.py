"""The torch op equals the C++ library bit for bit: the same logical weights go through the op
and through the `w4a8moe` program (a case file in; `run` gives the output bits, `pack` the packed
bytes). The packed header is also decoded here, independently of the C++ code."""

import json
import os
import pathlib
import struct
import subprocess

import pytest
import torch

import w4a8moe
from moe_data import make_inputs, make_weights


def cli_path():
    """The program built next to the package (<build>/w4a8moe), or $W4A8MOE_CLI."""
    if "W4A8MOE_CLI" in os.environ:
        return pathlib.Path(os.environ["W4A8MOE_CLI"])
    return pathlib.Path(w4a8moe.__file__).resolve().parents[2] / "w4a8moe"


CLI = cli_path()
needs_cli = pytest.mark.skipif(
    not CLI.is_file() and "W4A8MOE_CLI" not in os.environ,
    reason=f"the w4a8moe program is not built ({CLI}); set W4A8MOE_CLI")

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}


def tensor_bytes(t):
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(
        torch.uint8).numpy().tobytes()


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        data = tensor_bytes(t)
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path, name):
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8:8 + size])[name]
    dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}[entry["dtype"]]
    begin, end = entry["data_offsets"]
    data = bytearray(raw[8 + size + begin:8 + size + end])
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(entry["shape"])


def bits(t):
    """The bit patterns of a float tensor, as integers."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def run_program(tmp_path, weights, x, ids, wts, activation, apply_on_input, alpha, limit,
                isa=None):
    tensors = {"x": x, "topk_ids": ids, "topk_weights": wts, "w13": weights.w13,
               "w13_scale": weights.w13_scale, "w2": weights.w2, "w2_scale": weights.w2_scale}
    if weights.w13_bias is not None:
        tensors.update(w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)
    metadata = {"group_size": str(weights.group_size), "activation": activation,
                "apply_router_weight_on_input": "true" if apply_on_input else "false",
                "alpha": repr(alpha), "limit": repr(limit),
                "gate_up_layout": weights.gate_up_layout}
    case, out = tmp_path / "case.safetensors", tmp_path / "out.safetensors"
    write_safetensors(case, tensors, metadata)
    env = dict(os.environ)
    if isa is not None:
        env["W4A8MOE_ISA"] = isa
    result = subprocess.run([str(CLI), "run", "--input", str(case), "--output", str(out)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return read_safetensors(out, "out")


CASES = [  # (E, I, H, g, T, K, x dtype, activation, apply on input, bias, layout, scale dtype)
    (8, 128, 256, 64, 37, 2, torch.float32, "silu", False, False, "halves", torch.bfloat16),
    (8, 128, 256, -1, 5, 2, torch.bfloat16, "gelu", False, False, "halves", torch.float32),
    (4, 192, 384, 96, 64, 3, torch.float16, "swigluoai", False, True, "interleaved",
     torch.float32),
    (6, 256, 128, 32, 1, 4, torch.bfloat16, "swiglustep", True, True, "halves", torch.float16),
    (8, 96, 160, 32, 130, 2, torch.float32, "gelu_tanh", True, False, "halves", torch.bfloat16),
]


@needs_cli
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[7]}-g{c[3]}-T{c[4]}-{c[6]}")
def test_op_equals_program_bits(tmp_path, case):
    E, I, H, g, T, K, dtype, activation, on_input, bias, layout, scale_dtype = case
    weights = make_weights(E, I, H, g, 31, bias=bias, gate_up_layout=layout,
                           scale_dtype=scale_dtype, gain13=3.0, gain2=0.3)
    x, ids, wts = make_inputs(T, H, E, K, 31, dtype)
    ids = ids.to(torch.int32) if T % 2 else ids
    alpha, limit = (1.5, 6.0) if activation.startswith("swiglu") else (1.702, 7.0)
    out = w4a8moe.moe(x, ids, wts, *weights.pack(), activation=activation,
                      apply_router_weight_on_input=on_input, alpha=alpha, limit=limit)
    expected = run_program(tmp_path, weights, x, ids, wts, activation, on_input, alpha, limit)
    assert expected.dtype == out.dtype and expected.shape == out.shape
    assert torch.equal(bits(out), bits(expected))


@needs_cli
@pytest.mark.parametrize("isa", w4a8moe.available_kernel_sets())
def test_op_equals_program_bits_for_every_kernel_set(tmp_path, isa):
    weights = make_weights(6, 160, 320, 32, 17, bias=True)
    x, ids, wts = make_inputs(50, 320, 6, 2, 17, torch.bfloat16)
    previous = w4a8moe.active_kernel_set()  # capping at the active set restores the state
    try:
        w4a8moe.set_isa_cap(isa)
        assert w4a8moe.active_kernel_set() == isa
        out = w4a8moe.moe(x, ids, wts, *weights.pack(), activation="swigluoai")
    finally:
        w4a8moe.set_isa_cap(previous)
    expected = run_program(tmp_path, weights, x, ids, wts, "swigluoai", False, 1.702, 7.0, isa)
    assert torch.equal(bits(out), bits(expected))


def program_has_pack():
    if not CLI.is_file():
        return False
    return subprocess.run([str(CLI), "pack", "--help"], capture_output=True).returncode == 0


def packed_buffers_in_file(raw):
    """The packed buffers of a `w4a8moe pack` file: each starts on a 4096-byte boundary with the
    packed header's magic, and its header gives its size."""
    found = {}
    for offset in range(4096, len(raw), 4096):
        if raw[offset:offset + 8] == b"W4A8MOE\0":
            (role,) = struct.unpack("<I", raw[offset + 20:offset + 24])
            (total,) = struct.unpack("<Q", raw[offset + 56:offset + 64])
            found["w13" if role == 0 else "w2"] = raw[offset:offset + total]
    return found


@needs_cli
@pytest.mark.skipif(not program_has_pack(), reason="this w4a8moe program has no `pack` command")
@pytest.mark.parametrize("layout,bias,storage", [("halves", False, "as_given"),
                                                 ("interleaved", True, "bf16")])
def test_packed_bytes_equal_the_programs(tmp_path, layout, bias, storage):
    weights = make_weights(5, 96, 192, 32, 23, bias=bias, gate_up_layout=layout,
                           scale_dtype=torch.float32)
    x, ids, wts = make_inputs(3, 192, 5, 2, 23)
    w13_packed, w2_packed = weights.pack(scale_storage=storage)
    tensors = {"x": x, "topk_ids": ids, "topk_weights": wts, "w13": weights.w13,
               "w13_scale": weights.w13_scale, "w2": weights.w2, "w2_scale": weights.w2_scale}
    if bias:
        tensors.update(w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)
    case, packed_file = tmp_path / "case.safetensors", tmp_path / "w.w4a8"
    write_safetensors(case, tensors, {"group_size": "32", "activation": "silu",
                                      "gate_up_layout": layout})
    result = subprocess.run([str(CLI), "pack", "--input", str(case), "--output",
                             str(packed_file), "--scales", storage],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = packed_buffers_in_file(packed_file.read_bytes())
    assert found.keys() == {"w13", "w2"}
    assert found["w13"] == tensor_bytes(w13_packed)
    assert found["w2"] == tensor_bytes(w2_packed)


@needs_cli
def test_program_comparison_can_fail(tmp_path):
    """The comparison notices a different activation (a check that could not fail is none)."""
    weights = make_weights(4, 64, 128, 32, 8)
    x, ids, wts = make_inputs(8, 128, 4, 2, 8)
    out = w4a8moe.moe(x, ids, wts, *weights.pack(), activation="silu")
    other = run_program(tmp_path, weights, x, ids, wts, "gelu", False, 1.702, 7.0)
    assert not torch.equal(out, other)


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.mark.parametrize("group,bias", [(64, True), (-1, False)])
def test_packed_header(group, bias):
    weights = make_weights(5, 96 if group == -1 else 128, 192, group, 4, bias=bias)
    w13_packed, w2_packed = weights.pack()
    for packed, role, rows, cols in ((w13_packed, 0, weights.w13.shape[1], 192),
                                     (w2_packed, 1, 192, weights.w2.shape[2])):
        raw = tensor_bytes(packed)
        assert raw[:8] == b"W4A8MOE\0"
        version, header_bytes, layout, role_, experts, n, k, g, scale_dtype, flags = \
            struct.unpack("<IIIIIIIiII", raw[8:48])
        expert_bytes, total_bytes = struct.unpack("<QQ", raw[48:64])
        weight_format, block_rows, panel_bytes = struct.unpack("<IIQ", raw[64:80])
        (checksum,) = struct.unpack("<Q", raw[120:128])
        assert (version, header_bytes, role_, experts, n, k, g) == (2, 128, role, 5, rows, cols,
                                                                    group)
        # int4 symmetric; w13's gate and up alternate in blocks of 64 rows; records of 64 bytes
        assert (weight_format, block_rows) == (0, 64)
        assert panel_bytes % 64 == 0 and expert_bytes % panel_bytes == 0
        assert scale_dtype == (0 if group == -1 else 1)  # f32 / bf16, as given
        assert flags == (1 if bias else 0)
        assert total_bytes == len(raw) == 128 + experts * expert_bytes and expert_bytes % 64 == 0
        assert checksum == fnv1a64(raw[:120])
        info = w4a8moe.packed_info(packed)
        assert (info.version, info.experts, info.rows, info.cols, info.group_size,
                info.has_bias, info.total_bytes) == (2, 5, rows, cols, group, bias, len(raw))
        assert info.layout and info.role == ("w13" if role == 0 else "w2")


def test_packing_is_deterministic():
    weights = make_weights(4, 64, 128, 32, 9, bias=True)
    first, second = weights.pack(), weights.pack()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    original = w4a8moe.pack_with_original_op(
        weights.w13, weights.w2, weights.w13_scale, weights.w2_scale, 32,
        w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)
    assert all(torch.equal(a, b) for a, b in zip(first, original))
