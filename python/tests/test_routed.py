"""moe_routed: the router's top-k inside the op, against an independent reference: vLLM 0.32's
CPU router (vllm/model_executor/layers/fused_moe/router/cpu_router.py) written plainly in torch
here, feeding the op dynamic_4bit_int_moe_ex.

What is equal, and why. Both sides choose the same experts (each case checks its data keeps a
margin at every decision, see below) and run the same forward(), whose output does not depend on
the order of a token's slots (it sums the experts in ascending order). The weights are the same
numbers in float32 computed two ways: the library with the C library's expf and divisions, torch
with its vectorised exp (softmax: an exp of 2 ulp and a multiplication by the reciprocal of the
sum) and its own summation order. So the outputs are bit-identical where the weights are exact
(top-1 with renormalisation: 1.0, times the scaling factor) and otherwise agree within
float32 rounding: per element, r * sum_k |w_k y_k| + one unit in the last place of the output
dtype, with y_k expert k's output and r = (2 E + 5 K + 16) 2^-24 (each side's weights carry at
most about E + 2K + 8 roundings: the exps, a sum over at most E scores, the divisions, the
renormalisation's sum over K, the scaling; the K products of the accumulation one more each).
A wrong expert moves outputs by their own order, which each case checks the bound catches.

Ties: torch.topk does not give the lowest index among equal values (tie -> [4, 7] of
[0.5, 1, 1, 0.2, 1, 1, ...]), the library does. And near-ties could flip on the last bits of
the scores. So the data is tie-free with a margin: every case asserts that the K-th and
(K+1)-th selection values, and the topk_group-th and next group scores, differ by at least
MARGIN.
"""

import math

import pytest
import torch

import w4a8moe
from moe_data import make_weights

E, I, H, G = 16, 64, 128, 32
U = 2.0 ** -24
MARGIN = 1e-4
TOKENS = (1, 7, 64)
op = torch.ops.w4a8moe.moe_routed
forward = torch.ops.w4a8moe.dynamic_4bit_int_moe_ex


def reference_routing(logits, top_k, scoring_func, renormalize, scaling=1.0, groups=1,
                      topk_group=1, bias=None):
    """(weights f32 [T, K], ids int64 [T, K], margin) as vLLM's CPU router computes them, in
    float32. Ungrouped softmax without a bias: its _softmax_topk (the top-k logits; weights
    their softmax when renormalising, else exp(logit - logsumexp)), no scaling there (the
    caller passes 1.0, as vLLM's router applies none). Otherwise its _grouped_topk, which with
    one group is also what vLLM's other routers do for the ungrouped cases its CPU router
    lacks (sigmoid; a correction bias). margin: the smallest gap at a decision."""
    logits = logits.float()
    tokens, experts = logits.shape
    margins = []
    if scoring_func == "softmax" and bias is None and groups == 1:
        choice = logits
        values, ids = torch.topk(logits, top_k, dim=-1)
        if renormalize:
            weights = torch.softmax(values, dim=-1)
        else:
            weights = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        masked = logits
    else:
        scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else logits.sigmoid()
        choice = scores if bias is None else scores + bias.float().unsqueeze(0)
        per_group = choice.view(tokens, groups, -1)
        if bias is not None:
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = per_group.max(dim=-1).values
        if topk_group < groups:
            ranked = group_scores.sort(dim=-1, descending=True).values
            margins.append((ranked[:, topk_group - 1] - ranked[:, topk_group]).min())
        group_idx = torch.topk(group_scores, topk_group, dim=-1)[1]
        keep = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, group_idx, True)
        masked = choice.masked_fill(~keep.repeat_interleave(experts // groups, dim=1),
                                    float("-inf"))
        ids = torch.topk(masked, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    ranked = masked.sort(dim=-1, descending=True).values
    if top_k < experts and torch.isfinite(ranked[:, top_k]).all():
        margins.append((ranked[:, top_k - 1] - ranked[:, top_k]).min())
    if scaling != 1.0:
        weights = weights * scaling
    margin = min(m.item() for m in margins) if margins else math.inf
    return weights.float(), ids.long(), margin


def runner_up_ids(logits, ids, reference):
    """ids with each token's last choice replaced by the best expert not chosen (a wrong
    routing for the negative check)."""
    wrong = ids.clone()
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    wrong[:, -1] = reference.masked_fill(chosen, float("-inf")).argmax(dim=-1)
    return wrong


# name: (top_k, scoring_func, renormalize, routed_scaling_factor, num_expert_group, topk_group,
#        correction bias)
CASES = {
    "softmax-renormalize": (4, "softmax", True, 1.0, 1, 1, False),  # Mixtral, Qwen3-MoE
    "softmax": (4, "softmax", False, 1.0, 1, 1, False),  # Qwen2-MoE, OLMoE
    "deepseek-v3": (4, "sigmoid", True, 2.5, 4, 2, True),  # noaux_tc: top-2 sums
    "deepseek-v2": (4, "softmax", False, 16.0, 4, 2, False),  # group_limited_greedy: max
    "softmax-groups-renormalize": (4, "softmax", True, 1.0, 4, 2, False),
    "sigmoid-bias": (4, "sigmoid", True, 2.5, 1, 1, True),  # ungrouped (MiniMax-M2's routing)
    "sigmoid": (2, "sigmoid", False, 1.0, 1, 1, False),
    "softmax-all-experts": (E, "softmax", True, 1.0, 1, 1, False),  # top-k = E
}


@pytest.fixture(scope="module")
def packed():
    weights = make_weights(E, I, H, G, 5)
    return weights.pack()


def make_logits(tokens, seed, dtype=torch.float32):
    """Logits of order one, each token's a permutation of E values 0.25 apart plus noise below
    0.05 (so that every gap is at least 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.arange(E, dtype=torch.float32) - E / 2) * 0.25
    perm = torch.stack([torch.randperm(E, generator=gen) for _ in range(tokens)])
    noise = 0.05 * torch.rand(tokens, E, generator=gen)
    return (base[perm] + noise).to(dtype)


def make_bias(seed):
    gen = torch.Generator().manual_seed(seed + 7)
    return 0.1 * torch.rand(E, generator=gen)


def expert_outputs(x, ids, packed):
    """|y_k|: each chosen expert's output for each token, [T, K, H] in float32."""
    w13, w2 = packed
    ones = torch.ones(ids.shape[0], 1)
    return torch.stack([forward(x, ids[:, k:k + 1], ones, w13, w2, H, I, G, False, 2, 1.702, 7.0)
                        .float().abs() for k in range(ids.shape[1])], dim=1)


def bound(ref, weights, ys, top_k):
    r = (2 * E + 5 * top_k + 16) * U
    s = (weights.abs().unsqueeze(-1) * ys).sum(dim=1)
    if ref.dtype != torch.float32:
        s = s * (1 + torch.finfo(ref.dtype).eps)  # y_k came rounded to the output dtype
    return r * s + torch.finfo(ref.dtype).eps * ref.float().abs()


def call(x, logits, packed, case, bias=None, on_input=False):
    top_k, scoring, renormalize, scaling, groups, topk_group, _ = case
    w13, w2 = packed
    return op(x, logits, w13, w2, H, I, G, on_input, 2, 1.702, 7.0, top_k, scoring, renormalize,
              scaling, groups, topk_group, bias)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_vllm_routing(packed, name, tokens):
    case = CASES[name]
    top_k, scoring, renormalize, scaling, groups, topk_group, with_bias = case
    seed = 100 * tokens + list(CASES).index(name)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))
    logits = make_logits(tokens, seed)
    bias = make_bias(seed) if with_bias else None
    weights, ids, margin = reference_routing(logits, top_k, scoring, renormalize, scaling,
                                             groups, topk_group, bias)
    assert margin >= MARGIN, f"seed {seed}: the data has a near-tie ({margin:.3g})"
    w13, w2 = packed
    ref = forward(x, ids, weights, w13, w2, H, I, G, False, 2, 1.702, 7.0)
    out = call(x, logits, packed, case, bias)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(ref).all() and ref.abs().mean() > 0.05  # of order one, not zero
    tol = bound(ref, weights, expert_outputs(x, ids, packed), top_k)
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), (f"seed {seed}: max error {err.max().item():.3g}, "
                                f"{(err / tol).max().item():.3g}x the bound")
    if top_k < E:  # the bound catches a wrong expert
        wrong_ids = runner_up_ids(logits, ids, logits.float())
        wrong = forward(x, wrong_ids, weights, w13, w2, H, I, G, False, 2, 1.702, 7.0)
        assert ((out.float() - wrong.float()).abs() > tol).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes(packed, dtype):
    """x and the logits in bfloat16 / float16 (the logits widened to float32 exactly on both
    sides), on DeepSeek-V3's routing with a bfloat16 correction bias."""
    case = CASES["deepseek-v3"]
    top_k, scoring, renormalize, scaling, groups, topk_group, _ = case
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits = make_logits(64, 3, dtype)
    bias = make_bias(3).to(torch.bfloat16)
    weights, ids, margin = reference_routing(logits, top_k, scoring, renormalize, scaling,
                                             groups, topk_group, bias)
    assert margin >= MARGIN
    w13, w2 = packed
    ref = forward(x, ids, weights, w13, w2, H, I, G, False, 2, 1.702, 7.0)
    out = call(x, logits, packed, case, bias)
    assert out.dtype == dtype
    tol = bound(ref, weights, expert_outputs(x, ids, packed), top_k)
    assert ((out.float() - ref.float()).abs() <= tol).all()


@pytest.mark.parametrize("scoring,groups,topk_group,with_bias", [
    ("softmax", 1, 1, False), ("sigmoid", 1, 1, False), ("sigmoid", 4, 2, True),
    ("softmax", 4, 1, False)])
def test_top1_renormalized_is_bit_identical(packed, scoring, groups, topk_group, with_bias):
    """Top-1 with renormalisation: every weight is exactly the scaling factor on both sides,
    so the op's output is the reference's to the bit (strided x rows too)."""
    x = torch.randn(64, 2 * H, generator=torch.Generator().manual_seed(9))[:, :H]
    logits = make_logits(64, 9)
    bias = make_bias(9) if with_bias else None
    case = (1, scoring, True, 2.5, groups, topk_group, with_bias)
    weights, ids, margin = reference_routing(logits, 1, scoring, True, 2.5, groups, topk_group,
                                             bias)
    assert margin >= MARGIN and (weights == 2.5).all()
    w13, w2 = packed
    ref = forward(x, ids, weights, w13, w2, H, I, G, False, 2, 1.702, 7.0)
    assert torch.equal(call(x, logits, packed, case, bias), ref)


def test_router_weight_on_input(packed):
    """apply_router_weight_on_input (top-1, sigmoid, as Llama 4's layers): the weight scales the
    row before its int8 quantization, so a last-bit difference of a weight may move a quantized
    value one step: the loose bound of the accuracy tests."""
    from moe_data import assert_matches

    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4))
    logits = make_logits(64, 4)
    case = (1, "sigmoid", False, 1.0, 1, 1, False)
    weights, ids, margin = reference_routing(logits, 1, "sigmoid", False)
    assert margin >= MARGIN
    w13, w2 = packed
    ref = forward(x, ids, weights, w13, w2, H, I, G, True, 2, 1.702, 7.0)
    assert_matches(call(x, logits, packed, case, on_input=True), ref, "on input", tight=False)


def test_slot_order_does_not_change_the_output(packed):
    """What the bit-identity above rests on: forward() gives the same bits for a token's slots
    in any order."""
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    weights, ids, _ = reference_routing(make_logits(7, 2), 4, "softmax", True)
    w13, w2 = packed
    a = forward(x, ids, weights, w13, w2, H, I, G, False, 2, 1.702, 7.0)
    b = forward(x, ids.flip(1), weights.flip(1), w13, w2, H, I, G, False, 2, 1.702, 7.0)
    assert torch.equal(a, b)


def test_any_threads_give_the_same_bits(packed):
    """The routing runs in chunks of tokens on PyTorch's threads when the forward does (setting
    0), on the calling thread otherwise: the same bits either way, for any thread count."""
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(12))
    logits = make_logits(300, 12)
    bias = make_bias(12)
    case = CASES["deepseek-v3"]
    own, torch_threads = w4a8moe.get_num_threads(), torch.get_num_threads()
    outs = []
    try:
        for setting, threads in ((1, 1), (0, 1), (0, 2), (0, 3)):
            w4a8moe.set_num_threads(setting)
            torch.set_num_threads(threads)
            outs.append(call(x, logits, packed, case, bias))
    finally:
        w4a8moe.set_num_threads(own)
        torch.set_num_threads(torch_threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_python_wrapper_and_empty_batch(packed):
    w13, w2 = packed
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    logits = make_logits(7, 1)
    bias = make_bias(1)
    out = w4a8moe.moe_routed(x, logits, w13, w2, top_k=4, renormalize=True,
                             scoring_func="sigmoid", routed_scaling_factor=2.5,
                             num_expert_group=4, topk_group=2, e_score_correction_bias=bias)
    assert torch.equal(out, call(x, logits, packed, CASES["deepseek-v3"], bias))
    empty = w4a8moe.moe_routed(x[:0], logits[:0], w13, w2, top_k=4, renormalize=True)
    assert empty.shape == (0, H) and empty.dtype == x.dtype


# (arguments changed from a good softmax call, the error's pattern)
BAD = [
    (dict(scoring_func="softplus"), r"scoring_func: expected 'softmax' or 'sigmoid', got "
                                    r"'softplus'"),
    (dict(top_k=0), r"top_k: expected 1 to 16 \(the experts in w13_packed\), got 0"),
    (dict(top_k=17), r"top_k: expected 1 to 16 \(the experts in w13_packed\), got 17"),
    (dict(num_expert_group=3), r"num_expert_group: expected a divisor of 16 \(the experts in "
                               r"w13_packed\), got 3"),
    (dict(num_expert_group=4, topk_group=5), r"topk_group: expected 1 to 4 \(num_expert_group\), "
                                             r"got 5"),
    (dict(num_expert_group=8, topk_group=1), r"topk_group: expected at least 2 groups of 2 "
                                             r"experts, to hold top_k = 4 experts, got 1"),
    (dict(num_expert_group=16, topk_group=4, bias=True),
     r"num_expert_group: expected groups of 2 experts or more .*got 16 groups of 1"),
    (dict(routed_scaling_factor=math.inf), r"routed_scaling_factor: expected a finite float32, "
                                           r"got inf"),
    (dict(logits_columns=3), r"router_logits: expected shape \[5, 16\] \(T from x, E the "
                             r"experts in w13_packed\), got \[5, 3\]"),
    (dict(logits_rows=4), r"router_logits: expected shape \[5, 16\] .*got \[4, 16\]"),
    (dict(logits_dtype=torch.int32), r"router_logits: expected dtype float32, bfloat16 or "
                                     r"float16, got (Int|torch.int32)"),
    (dict(bias_shape=(8,)), r"e_score_correction_bias: expected shape \[16\] \(the experts in "
                            r"w13_packed\), got \[8\]"),
    (dict(x_columns=64), r"x: expected 128 columns \(hidden_size\), got shape \[5, 64\]"),
    (dict(activation_kind=9), r"activation: expected a code in \[0, 4\]"),
]


def bad_call(packed, device="cpu", logits_columns=E, logits_rows=5, logits_dtype=torch.float32,
             bias=False, bias_shape=(E,), x_columns=H, activation_kind=2, **routing):
    args = dict(top_k=4, scoring_func="softmax", renormalize=True, routed_scaling_factor=1.0,
                num_expert_group=1, topk_group=1)
    args.update(routing)
    x = torch.randn(5, x_columns).to(device)
    logits = torch.randn(logits_rows, logits_columns).to(logits_dtype).to(device)
    b = torch.rand(bias_shape).to(device) if bias or bias_shape != (E,) else None
    w13, w2 = packed
    if device == "meta":
        w13 = torch.empty(w13.shape, dtype=torch.uint8, device="meta")
        w2 = torch.empty(w2.shape, dtype=torch.uint8, device="meta")
    return op(x, logits, w13, w2, H, I, G, False, activation_kind, 1.702, 7.0, args["top_k"],
              args["scoring_func"], args["renormalize"], args["routed_scaling_factor"],
              args["num_expert_group"], args["topk_group"], b)


@pytest.mark.parametrize("change,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_name_the_argument(packed, change, message):
    with pytest.raises(RuntimeError, match=message):
        bad_call(packed, **change)


@pytest.mark.parametrize("change,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_meta_kernel_checks_the_same(packed, change, message):
    """On meta tensors (the C++ Meta kernel on torch 1.x, _fake.py on torch 2), E comes from
    the logits' columns: the same sentences, with that source where E is named."""
    if "logits_columns" in change:  # E = 3 then: top_k = 4 is out of range
        message = r"top_k: expected 1 to 3 \(the columns of router_logits\), got 4"
    message = message.replace(r"the experts in w13_packed", r"the columns of router_logits")
    with pytest.raises(RuntimeError, match=message):
        bad_call(packed, device="meta", **change)


def test_meta_output(packed):
    out = bad_call(packed, device="meta", bias=True, num_expert_group=4, topk_group=2)
    assert out.device.type == "meta" and out.shape == (5, H) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# torch 2: opcheck, torch.compile

torch2 = pytest.mark.skipif(
    int(torch.__version__.split(".")[0]) < 2 or not hasattr(torch.library, "opcheck"),
    reason=f"torch {torch.__version__} has no torch.library.opcheck / torch.compile")


@torch2
@pytest.mark.parametrize("name,dtype", [("softmax-renormalize", torch.float32),
                                        ("deepseek-v3", torch.bfloat16),
                                        ("deepseek-v2", torch.float16),
                                        ("sigmoid", torch.float32)])
def test_opcheck(packed, name, dtype):
    top_k, scoring, renormalize, scaling, groups, topk_group, with_bias = CASES[name]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(6)).to(dtype)
    logits = make_logits(5, 6, dtype)
    w13, w2 = packed
    args = (x, logits, w13, w2, H, I, G, False, 2, 1.702, 7.0, top_k, scoring, renormalize,
            scaling, groups, topk_group, make_bias(6) if with_bias else None)
    torch.library.opcheck(op.default, args)


class RoutedMoE(torch.nn.Module):
    """Router (linear), then the op with the top-k inside: a serving engine's MoE layer."""

    def __init__(self, packed):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(7)
            self.router.weight.copy_(torch.randn(E, H, generator=gen) / H ** 0.5)
        self.register_buffer("w13_packed", packed[0])
        self.register_buffer("w2_packed", packed[1])
        self.register_buffer("bias", make_bias(7))

    def forward(self, x):
        logits = self.router(x)
        out = op(x, logits, self.w13_packed, self.w2_packed, H, I, G, False, 2, 1.702, 7.0, 4,
                 "sigmoid", True, 2.5, 4, 2, self.bias)
        return out, logits


@torch2
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_one_graph_for_every_token_count(packed, backend):
    """fullgraph=True (a graph break would raise); one compilation serves T = 1, 7 and 64, the
    token count symbolic through the fake kernel; the output is the eager op's on the logits
    the compiled graph computed, to the bit."""
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.testing import CompileCounterWithBackend

    module = RoutedMoE(packed).requires_grad_(False)
    old = fx_config.backed_size_oblivious
    fx_config.backed_size_oblivious = True  # let T = 1 share the dynamic graph
    try:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
        for tokens in TOKENS:
            x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
            if tokens == TOKENS[0]:
                torch._dynamo.mark_dynamic(x, 0)
            out, logits = compiled(x)
            e_out, e_logits = module(x)
            assert out.shape == (tokens, H)
            again = op(x, logits, module.w13_packed, module.w2_packed, H, I, G, False, 2, 1.702,
                       7.0, 4, "sigmoid", True, 2.5, 4, 2, module.bias)
            assert torch.equal(out, again), f"T={tokens}: compiled op differs from eager op"
            if backend == "aot_eager":
                assert torch.equal(logits, e_logits) and torch.equal(out, e_out)
        assert counter.frame_count == 1, f"{counter.frame_count} compilations for {TOKENS}"
    finally:
        fx_config.backed_size_oblivious = old


# ---------------------------------------------------------------------------------------------
# vLLM's own router (where vLLM is installed): the plugin's arguments give its routing


@pytest.mark.parametrize("grouped,scoring,renormalize,scaling,groups,topk_group,with_bias", [
    (False, "softmax", True, 1.0, None, None, False),
    (False, "softmax", False, 2.0, None, None, False),  # vLLM applies no scaling here
    (True, "sigmoid", True, 2.5, 4, 2, True),
    (True, "softmax", False, 16.0, 4, 2, False),
    (True, "sigmoid", True, 1.0, 1, 1, True),  # one group
])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_plugin_arguments_route_as_vllm(packed, grouped, scoring, renormalize, scaling, groups,
                                        topk_group, with_bias, logits_dtype):
    """vLLM's own select_experts (where vLLM is installed) chooses the reference's experts, and
    moe_routed with the plugin's op_routing() arguments agrees with vLLM's routing fed to
    dynamic_4bit_int_moe_ex: within the bound above plus what vLLM's weights differ from the
    float32 reference's (measured; with bfloat16 logits vLLM's ungrouped top-k computes its
    weights in bfloat16, the op in float32)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

    from w4a8moe.vllm_plugin.core import Routing, op_routing

    x = torch.randn(64, H, generator=torch.Generator().manual_seed(8))
    logits = make_logits(64, 8, logits_dtype)
    bias = make_bias(8) if with_bias else None
    v_weights, v_ids = select_experts(
        hidden_states=x, router_logits=logits, top_k=4, use_grouped_topk=grouped,
        renormalize=renormalize, topk_group=topk_group, num_expert_group=groups,
        scoring_func=scoring, routed_scaling_factor=scaling, e_score_correction_bias=bias)
    fused = op_routing(Routing(scoring, renormalize, grouped), groups, topk_group, bias, scaling)
    assert fused is not None
    weights, ids, margin = reference_routing(logits, 4, *fused)
    assert margin >= MARGIN
    # the same experts; vLLM's weights in the reference's slot order
    v_ids, order = v_ids.long().sort(dim=-1)
    v_weights = v_weights.float().gather(1, order)
    ids, order = ids.sort(dim=-1)
    weights = weights.gather(1, order)
    assert torch.equal(ids, v_ids)
    w13, w2 = packed
    out = op(x, logits, w13, w2, H, I, G, False, 2, 1.702, 7.0, 4, *fused)
    ref = forward(x, v_ids, v_weights, w13, w2, H, I, G, False, 2, 1.702, 7.0)
    ys = expert_outputs(x, ids, packed)
    tol = bound(ref, weights, ys, 4) + ((v_weights - weights).abs().unsqueeze(-1) * ys).sum(1)
    err = (out - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g}"
