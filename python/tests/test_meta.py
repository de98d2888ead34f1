"""Meta tensors, FakeTensorMode and graph capture: shapes and dtypes without computation."""

import pytest
import torch

import w4a8moe
from moe_data import make_inputs, make_weights

try:
    from torch._subclasses.fake_tensor import FakeTensorMode
except ImportError:  # pragma: no cover - every torch since 1.13 has it
    FakeTensorMode = None

needs_fake = pytest.mark.skipif(FakeTensorMode is None,
                                reason=f"torch {torch.__version__} has no FakeTensorMode")

E, I, H, K, G = 8, 128, 256, 2, 64


@pytest.fixture(scope="module")
def case():
    weights = make_weights(E, I, H, G, 11)
    return weights, weights.pack()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_meta_tensors(case, dtype, tokens):
    _, (w13_packed, w2_packed) = case
    meta = torch.device("meta")
    x = torch.empty(tokens, H, dtype=dtype, device=meta)
    ids = torch.empty(tokens, K, dtype=torch.int32, device=meta)
    wts = torch.empty(tokens, K, dtype=torch.float32, device=meta)
    # Packed tensors without data: a CPU kernel could not even read their headers.
    w13 = torch.empty(w13_packed.shape, dtype=torch.uint8, device=meta)
    w2 = torch.empty(w2_packed.shape, dtype=torch.uint8, device=meta)
    for out in (torch.ops.w4a8moe.dynamic_4bit_int_moe(x, ids, wts, w13, w2, H, I, G, False, 2),
                torch.ops.w4a8moe.dynamic_4bit_int_moe_ex(x, ids, wts, w13, w2, H, I, G, True, 1,
                                                          1.5, 6.0),
                w4a8moe.moe(x, ids, wts, w13, w2, hidden_size=H, intermediate_size=I,
                            group_size=G)):
        assert out.device.type == "meta"
        assert out.shape == (tokens, H) and out.dtype == dtype


def test_meta_checks_shapes(case):
    meta = torch.device("meta")
    x = torch.empty(4, H, device=meta)
    ids = torch.empty(4, K, dtype=torch.long, device=meta)
    w = torch.empty(100, dtype=torch.uint8, device=meta)
    op = torch.ops.w4a8moe.dynamic_4bit_int_moe
    with pytest.raises(RuntimeError, match=r"x: expected 512 columns \(hidden_size\)"):
        op(x, ids, torch.empty(4, K, device=meta), w, w, 512, I, G, False, 2)
    with pytest.raises(RuntimeError, match=r"topk_weights: expected shape \[4, 2\], got \[4, 3\]"):
        op(x, ids, torch.empty(4, 3, device=meta), w, w, H, I, G, False, 2)
    with pytest.raises(RuntimeError, match="activation: expected a code in"):
        op(x, ids, torch.empty(4, K, device=meta), w, w, H, I, G, False, 7)
    with pytest.raises(RuntimeError, match="meta or fake tensor has no data"):
        w4a8moe.moe(x, ids, torch.empty(4, K, device=meta), w, w)


@pytest.mark.parametrize("group,scale_dtype,bias,storage", [
    (64, torch.bfloat16, False, "as_given"),
    (64, torch.float32, True, "as_given"),
    (64, torch.float32, True, "bf16"),
    (-1, torch.float32, False, "as_given"),
    (32, torch.float16, True, "as_given"),
])
def test_meta_pack_sizes_equal_the_real_ones(group, scale_dtype, bias, storage):
    inter, hidden = (128, 192) if group == 64 else (96, 160)
    weights = make_weights(3, inter, hidden, group, 5, scale_dtype=scale_dtype, bias=bias)
    real = weights.pack(scale_storage=storage)
    args = [t.to("meta") if t is not None else None
            for t in (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)]
    biases = [t.to("meta") if t is not None else None for t in (weights.w13_bias, weights.w2_bias)]
    fake = torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format_ex(
        *args, group, *biases, "halves", storage, "")
    for r, f in zip(real, fake):
        assert f.device.type == "meta" and f.dtype == torch.uint8 and f.shape == r.shape
    if storage == "as_given":
        plain = torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format(*args, group, *biases)
        assert [p.shape for p in plain] == [r.shape for r in real]


@needs_fake
def test_fake_tensor_mode(case):
    weights, (w13_packed, w2_packed) = case
    x, ids, wts = make_inputs(9, H, E, K, 3, torch.bfloat16)
    garbage = torch.zeros_like(w13_packed)  # the CPU kernel would reject these bytes
    with FakeTensorMode() as mode:
        fx, fids, fwts = (mode.from_tensor(t) for t in (x, ids, wts))
        f13, f2 = mode.from_tensor(garbage), mode.from_tensor(w2_packed)
        out = torch.ops.w4a8moe.dynamic_4bit_int_moe(fx, fids, fwts, f13, f2, H, I, G, False, 2)
        assert type(out).__name__ == "FakeTensor"
        assert out.shape == (9, H) and out.dtype == torch.bfloat16 and out.device.type == "cpu"
        p13, p2 = w4a8moe.pack(*(mode.from_tensor(t) for t in (
            weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)), G)
        assert p13.shape == w13_packed.shape and p2.shape == w2_packed.shape
        assert p13.dtype == torch.uint8


def test_graph_capture_with_make_fx(case):
    try:
        from torch.fx.experimental.proxy_tensor import make_fx
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no make_fx")
    _, (w13_packed, w2_packed) = case
    x, ids, wts = make_inputs(5, H, E, K, 4)

    def layer(x, ids, wts, w13, w2):
        return torch.ops.w4a8moe.dynamic_4bit_int_moe(x, ids, wts, w13, w2, H, I, G, False,
                                                      2) * 2.0

    graph = make_fx(layer, tracing_mode="fake")(x, ids, wts, w13_packed, w2_packed)
    assert "w4a8moe.dynamic_4bit_int_moe" in graph.code
    assert torch.equal(graph(x, ids, wts, w13_packed, w2_packed),
                       layer(x, ids, wts, w13_packed, w2_packed))


def test_torch_compile(case):
    if not hasattr(torch, "compile"):
        pytest.skip(f"torch {torch.__version__} has no torch.compile (it came with 2.0); "
                    "the ops' meta kernels are what it would use")
    _, (w13_packed, w2_packed) = case
    x, ids, wts = make_inputs(5, H, E, K, 4)

    def layer(x, ids, wts):
        return torch.ops.w4a8moe.dynamic_4bit_int_moe(x, ids, wts, w13_packed, w2_packed, H, I,
                                                      G, False, 2) + 1.0

    compiled = torch.compile(layer, backend="eager")
    assert torch.equal(compiled(x, ids, wts), layer(x, ids, wts))
