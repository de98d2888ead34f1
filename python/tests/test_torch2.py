"""PyTorch 2: the ops under torch.library.opcheck, torch.compile and torch.export.

Skipped on torch 1.x, which has none of these (its C++ Meta kernels are tested in test_meta.py).
"""

import pytest
import torch

import w4a8moe
from moe_data import assert_matches, make_inputs, make_weights

if int(torch.__version__.split(".")[0]) < 2 or not hasattr(torch.library, "opcheck"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.opcheck / torch.compile",
                allow_module_level=True)

E, I, H, K = 8, 128, 256, 2

# Sample inputs for opcheck: every dtype, group size, activation, with and without biases and
# router weight on the input (each value at least once, not the whole product).
# (x dtype, group size, activation code, biases, apply_router_weight_on_input)
CASES = [
    (torch.float32, 32, 2, False, False),
    (torch.bfloat16, 128, 2, True, False),
    (torch.float16, -1, 2, False, True),
    (torch.float32, -1, 0, True, False),
    (torch.bfloat16, 32, 1, True, True),
    (torch.float16, 128, 3, False, False),
    (torch.float32, 128, 4, True, True),
    (torch.bfloat16, -1, 4, False, False),
]


def case_id(case):
    dtype, g, act, bias, on_input = case
    return (f"{str(dtype).split('.')[-1]}-g{g}-{w4a8moe.Activation(act).name.lower()}"
            f"{'-bias' if bias else ''}{'-on_input' if on_input else ''}")


def sample(case, tokens=5, seed=0):
    dtype, g, act, bias, on_input = case
    weights = make_weights(E, I, H, g, seed, bias=bias)
    x, ids, wts = make_inputs(tokens, H, E, K, seed, dtype)
    return weights, x, ids, wts


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_opcheck_forward_ops(case):
    weights, x, ids, wts = sample(case)
    _, g, act, _, on_input = case
    w13_packed, w2_packed = weights.pack()
    args = (x, ids, wts, w13_packed, w2_packed, H, I, g, on_input, act)
    torch.library.opcheck(torch.ops.w4a8moe.dynamic_4bit_int_moe.default, args)
    torch.library.opcheck(torch.ops.w4a8moe.dynamic_4bit_int_moe_ex.default,
                          args + (1.5, 6.0))


def test_opcheck_autograd_registration():
    """opcheck checks the autograd registration only when an input requires grad: x and the
    router weights do here (the ops are not differentiable: an Autograd fallthrough)."""
    weights, x, ids, wts = sample(CASES[1])
    w13_packed, w2_packed = weights.pack()
    x.requires_grad_(True)
    wts.requires_grad_(True)
    result = torch.library.opcheck(
        torch.ops.w4a8moe.dynamic_4bit_int_moe.default,
        (x, ids, wts, w13_packed, w2_packed, H, I, 128, False, 2),
        test_utils=("test_schema", "test_autograd_registration"))
    assert result["test_autograd_registration"] == "SUCCESS", result


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_opcheck_pack_ops(case):
    weights, *_ = sample(case)
    _, g, *_ = case
    args = (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale, g, weights.w13_bias,
            weights.w2_bias)
    torch.library.opcheck(torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format.default, args)
    torch.library.opcheck(torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format_ex.default,
                          args + ("halves", "bf16", ""))


def test_opcheck_catches_a_wrong_shape_function(monkeypatch):
    """The check above can fail: a fake implementation whose output shape is off by one row
    is caught (the real one is put back afterwards)."""
    from w4a8moe import _fake

    weights, x, ids, wts = sample(CASES[0])
    w13_packed, w2_packed = weights.pack()
    args = (x, ids, wts, w13_packed, w2_packed, H, I, 32, False, 2)
    real = _fake.moe_ex_fake

    def wrong(x, *rest, **kwargs):
        out = real(x, *rest, **kwargs)
        return out.new_empty((out.shape[0] + 1, out.shape[1]))

    monkeypatch.setattr(_fake, "moe_ex_fake", wrong)
    with pytest.raises(Exception, match="(?i)shape|size"):
        torch.library.opcheck(torch.ops.w4a8moe.dynamic_4bit_int_moe.default, args,
                              test_utils="test_faketensor")


def test_fake_checks_name_the_argument():
    weights, x, ids, wts = sample(CASES[0])
    p13, p2 = weights.pack()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fids, fw, f13, f2 = (mode.from_tensor(t) for t in (x, ids, wts, p13, p2))
        op = torch.ops.w4a8moe.dynamic_4bit_int_moe
        with pytest.raises(RuntimeError, match=r"topk_ids: expected shape \[5, K\], got \[4, 2\]"):
            op(fx, fids[:4], fw, f13, f2, H, I, 32, False, 2)
        with pytest.raises(RuntimeError, match=r"topk_weights: expected dtype float32"):
            op(fx, fids, fw.to(torch.int32), f13, f2, H, I, 32, False, 2)
        with pytest.raises(RuntimeError, match=r"group_size: expected -1 or a multiple of 32"):
            op(fx, fids, fw, f13, f2, H, I, 48, False, 2)


class TinyMoE(torch.nn.Module):
    """Router (linear, softmax, top-k), then the op: the shape of a serving engine's MoE."""

    def __init__(self, weights, activation=2):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.router = torch.nn.Linear(H, E, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(E, H, generator=gen) / H ** 0.5)
        w13_packed, w2_packed = weights.pack()
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w2_packed", w2_packed)
        self.group_size = weights.group_size
        self.activation = activation

    def forward(self, x):
        scores = torch.softmax(self.router(x).float(), dim=-1)
        topk_weights, topk_ids = torch.topk(scores, K, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = torch.ops.w4a8moe.dynamic_4bit_int_moe(
            x, topk_ids, topk_weights, self.w13_packed, self.w2_packed, H, I, self.group_size,
            False, self.activation)
        return out, topk_ids, topk_weights


@pytest.fixture(scope="module")
def tiny_moe():
    return TinyMoE(make_weights(E, I, H, 32, 21)).requires_grad_(False)


TOKENS = (1, 7, 64)


def inputs(tokens):
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))


@pytest.fixture
def size_oblivious():
    """Let a dynamic token count include 1: by default dynamo specialises sizes 0 and 1, which
    would give T = 1 a graph of its own."""
    import torch.fx.experimental._config as fx_config

    old = fx_config.backed_size_oblivious
    fx_config.backed_size_oblivious = True
    yield
    fx_config.backed_size_oblivious = old


def compile_counted(module, backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(module, fullgraph=True, dynamic=True, backend=counter), counter


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_one_graph_for_every_token_count(tiny_moe, size_oblivious, backend):
    """fullgraph=True: a graph break would raise. One compilation serves T = 1, 7 and 64.

    aot_eager (dynamo + AOTAutograd with the fake implementations, torch's own kernels): the
    whole module equals eager to the bit. inductor generates its own code for the router's
    softmax, whose last bits may differ from eager's (a torch matter, not the op's): the op's
    output equals the eager op's on the routing the compiled graph chose, to the bit."""
    compiled, counter = compile_counted(tiny_moe, backend)
    for tokens in TOKENS:
        x = inputs(tokens)
        if tokens == TOKENS[0]:
            torch._dynamo.mark_dynamic(x, 0)
        out, ids, wts = compiled(x)
        e_out, e_ids, e_wts = tiny_moe(x)
        assert out.shape == (tokens, H)
        if backend == "aot_eager":
            assert torch.equal(ids, e_ids) and torch.equal(wts, e_wts)
            assert torch.equal(out, e_out), f"T={tokens}: compiled output differs from eager"
        else:
            assert torch.equal(ids, e_ids)
            torch.testing.assert_close(wts, e_wts, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
            again = torch.ops.w4a8moe.dynamic_4bit_int_moe(
                x, ids, wts, tiny_moe.w13_packed, tiny_moe.w2_packed, H, I, 32, False, 2)
            assert torch.equal(out, again), f"T={tokens}: compiled op differs from eager op"
        assert_matches(out, e_out, f"T={tokens}", tight=False)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for T in {TOKENS}"


def test_compile_counter_sees_a_second_graph(tiny_moe):
    """The count above can fail: without the size-oblivious setting T = 1 gets its own graph."""
    compiled, counter = compile_counted(tiny_moe, "aot_eager")
    for tokens in TOKENS:
        compiled(inputs(tokens))
    assert counter.frame_count > 1


def test_export_with_a_dynamic_token_count(tiny_moe, size_oblivious):
    if not hasattr(torch, "export"):
        pytest.skip(f"torch {torch.__version__} has no torch.export")
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    program = torch.export.export(tiny_moe, (inputs(7),), dynamic_shapes={"x": {0: tokens}})
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "w4a8moe.dynamic_4bit_int_moe.default" in ops, ops
    module = program.module()
    for t in TOKENS:
        x = inputs(t)
        for a, b in zip(module(x), tiny_moe(x)):
            assert torch.equal(a, b), f"T={t}: exported program differs from eager"
    # And it survives a save/load round trip.
    import io

    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    x = inputs(64)
    assert torch.equal(loaded(x)[0], tiny_moe(x)[0])
