"""Expert parallelism over torch.distributed (w4a8moe.distributed): two processes with gloo.

Both ways (all_reduce, dispatch) equal the single-process forward within relative 1e-6 (f32
summation order), and the dispatch way with exact results equals it to the bit; each gives the
same bits from run to run and on every rank, over uneven shares, a scattered expert map, a rank
whose experts no token chose, tokens whose experts are all on the other rank, a rank without
tokens, every activation, bf16 x and the router weight on the input. Bad input (maps not
covering each expert once, a local count disagreeing with the packed weights, ranks disagreeing
on shapes or options) raises a clear error on every rank.

The ranks are subprocesses of this file (`python test_distributed.py SCENARIO RANK ...`) on a
free port; each launch is bounded by a timeout, so a hang fails instead of blocking. One launch
runs every layer case, one every bad input in sequence (the group stays usable after each).
"""

import datetime
import math
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import w4a8moe
import w4a8moe.distributed as ep
from moe_data import make_inputs, make_weights

RANKS = 2
LAUNCH_TIMEOUT = 240  # seconds, both ranks of one launch
I, H, G = 64, 128, 32

# Layer cases: E experts, top-k K, T tokens, activation, x dtype, router weight on the input,
# biases, routing ("random", "unused": no token chooses rank 1's experts, "elsewhere": token 0
# chooses only rank 1's experts and the last token only rank 0's), map ("even", "scattered"),
# split of the tokens over the ranks in the dispatch way ("even", "rank0": rank 1 has none).
BASE = dict(E=6, K=2, T=24, act="silu", dtype="float32", on_input=False, bias=False,
            routing="random", map="even", split="even", seed=1)
LAYER_CASES = {
    "base": {},
    "uneven_E5_K3": dict(E=5, K=3, T=21, seed=2),
    "experts_unused": dict(E=5, routing="unused", seed=3),
    "all_experts_elsewhere": dict(E=5, routing="elsewhere", seed=4),
    "swigluoai": dict(E=4, T=12, act="swigluoai", seed=5),
    "swiglustep": dict(E=4, T=12, act="swiglustep", seed=6),
    "gelu": dict(E=4, T=12, act="gelu", seed=7),
    "gelu_tanh": dict(E=4, T=12, act="gelu_tanh", seed=8),
    "bf16_bias": dict(E=5, dtype="bfloat16", bias=True, seed=9),
    "on_input_K1": dict(K=1, on_input=True, seed=10),
    "on_input_K2": dict(on_input=True, seed=11),
    "scattered_map": dict(E=5, map="scattered", seed=12),
    "rank_without_tokens": dict(E=5, split="rank0", seed=13),
    "K4": dict(E=8, K=4, T=16, seed=14),  # the f32 ways group a token's 4 slots per rank
}


def spec_of(name):
    s = dict(BASE)
    s.update(LAYER_CASES[name])
    return s


def expert_map_of(spec, rank):
    if spec["map"] == "scattered":  # rank 0 holds 4, 0, 2 (in that local order); rank 1: 1, 3
        maps = [[1, -1, 2, -1, 0], [-1, 0, -1, 1, -1]]
        return torch.tensor(maps[rank], dtype=torch.int32)
    return ep.even_split_expert_map(spec["E"], rank, RANKS)


def layer_data(spec):
    weights = make_weights(spec["E"], I, H, G, spec["seed"], bias=spec["bias"])
    x, ids, wts = make_inputs(spec["T"], H, spec["E"], spec["K"], spec["seed"],
                              getattr(torch, spec["dtype"]))
    if spec["routing"] == "unused":  # even split of 5: rank 1 holds 3 and 4
        wts, ids = torch.topk(torch.rand(spec["T"], 3, generator=torch.Generator().manual_seed(5)),
                              spec["K"])
    elif spec["routing"] == "elsewhere":
        ids[0] = torch.tensor([3, 4])
        ids[-1] = torch.tensor([0, 1])
    return weights, x, ids, wts


def token_starts(spec):
    T = spec["T"]
    if spec["split"] == "rank0":
        return [0, T, T]
    return [T * r // RANKS for r in range(RANKS + 1)]


# ---------------------------------------------------------------------------------------------
# The ranks (run as `python test_distributed.py SCENARIO RANK RANKS PORT OUT`)

def run_layer_case(spec, rank):
    weights, x, ids, wts = layer_data(spec)
    options = dict(activation=spec["act"], apply_router_weight_on_input=spec["on_input"])
    got = {"single": w4a8moe.moe(x, ids, wts, *weights.pack(), **options)}
    t0, t1 = token_starts(spec)[rank:rank + 2]
    for mode, result_dtype, exact in (("all_reduce", torch.float32, False),
                                      ("dispatch", torch.float32, False),
                                      ("dispatch", torch.bfloat16, False),
                                      ("dispatch", torch.float32, True)):
        layer = ep.ExpertParallelMoE.from_weights(
            weights.w13, weights.w2, weights.w13_scale, weights.w2_scale, G, weights.w13_bias,
            weights.w2_bias, expert_map=expert_map_of(spec, rank), mode=mode,
            result_dtype=result_dtype, exact=exact, **options)
        mine = (x, ids, wts) if mode == "all_reduce" else (x[t0:t1], ids[t0:t1], wts[t0:t1])
        key = "dispatch-exact" if exact else f"{mode}-{str(result_dtype).split('.')[-1]}"
        got[key] = [layer(*mine), layer(*mine)]  # twice: the same bits
    return got


def scenario_layers(rank):
    return {name: run_layer_case(spec_of(name), rank) for name in LAYER_CASES}


E_BAD = 5


def bad_case(name, rank):
    """One bad input; returns the error message this rank got, or None."""
    weights = make_weights(E_BAD, I, H, G, 40)
    x, ids, wts = make_inputs(8, H, E_BAD, 2, 40)
    even = ep.even_split_expert_map(E_BAD, rank, RANKS)  # rank 0: 0, 1, 2; rank 1: 3, 4
    maps = {
        "overlap": [[0, 1, 2, 3, -1], [-1, -1, -1, 0, 1]],
        "hole": [[0, 1, -1, -1, -1], [-1, -1, -1, 0, 1]],
        "bad_local_map": [[0, 1, 2, -1, -1], [-1, -1, -1, 0, 0]],
        "map_length": [[0, 1, 2, -1, -1], [-1, -1, -1, 0, 1, -1]],
    }
    w13, w2 = weights.w13, weights.w2
    kwargs = dict(expert_map=even)
    if name in maps:
        kwargs["expert_map"] = torch.tensor(maps[name][rank], dtype=torch.int32)
    try:
        if name in maps:
            ep.ExpertParallelMoE.from_weights(w13, w2, weights.w13_scale, weights.w2_scale, G,
                                              **kwargs)
        elif name == "count_vs_packed":
            # rank 1's map holds 3 and 4, its packed weights only expert 3
            experts = [0, 1, 2] if rank == 0 else [3]
            packed = weights.pack(experts=experts)
            ep.ExpertParallelMoE(*packed, even)
        elif name == "hidden_size":
            other = weights if rank == 0 else make_weights(E_BAD, I, 2 * H, G, 41)
            ep.ExpertParallelMoE.from_weights(other.w13, other.w2, other.w13_scale,
                                              other.w2_scale, G, expert_map=even)
        elif name == "activation":
            ep.ExpertParallelMoE.from_weights(w13, w2, weights.w13_scale, weights.w2_scale, G,
                                              expert_map=even,
                                              activation="silu" if rank == 0 else "gelu")
        elif name == "exact":
            ep.ExpertParallelMoE.from_weights(w13, w2, weights.w13_scale, weights.w2_scale, G,
                                              expert_map=even, mode="dispatch", exact=rank == 1)
        elif name in ("exact_bf16", "exact_all_reduce"):
            mode, result_dtype = (("dispatch", torch.bfloat16) if name == "exact_bf16"
                                  else ("all_reduce", torch.float32))
            ep.ExpertParallelMoE.from_weights(w13, w2, weights.w13_scale, weights.w2_scale, G,
                                              expert_map=even, mode=mode,
                                              result_dtype=result_dtype, exact=rank == 0)
        elif name in ("bad_ids_all_reduce", "bad_ids_dispatch", "top_k_dispatch"):
            layer = ep.ExpertParallelMoE.from_weights(
                w13, w2, weights.w13_scale, weights.w2_scale, G, expert_map=even,
                mode="dispatch" if name.endswith("dispatch") else "all_reduce")
            if rank == 1 and name.startswith("bad_ids"):
                ids = ids.clone()
                ids[3, 1] = E_BAD
            if rank == 1 and name == "top_k_dispatch":
                ids, wts = ids[:, :1].contiguous(), wts[:, :1].contiguous()
            layer(x, ids, wts)
        elif name == "still_usable":
            layer = ep.ExpertParallelMoE.from_weights(w13, w2, weights.w13_scale,
                                                      weights.w2_scale, G, mode="dispatch")
            want = w4a8moe.moe(x, ids, wts, *weights.pack())[4 * rank:4 * rank + 4]
            out = layer(x[4 * rank:4 * rank + 4], ids[4 * rank:4 * rank + 4],
                        wts[4 * rank:4 * rank + 4])
            if not torch.allclose(out, want, rtol=0, atol=1e-5 * want.abs().max().item()):
                return "the layer after the errors differs from the single-process forward"
        else:
            raise KeyError(name)
    except RuntimeError as e:
        return str(e)
    return None


# What every rank must say, per bad input (regular expressions).
BAD_CASES = {
    "overlap": [r"w4a8moe\.distributed: shards: expected each expert held by one process, got "
                r"expert 3 held by processes 0 and 1"] * 2,
    "hole": [r"w4a8moe\.distributed: shards: .*got expert 2 held by none"] * 2,
    "bad_local_map": [r"w4a8moe\.distributed: rank 1: expert_map: expected each local index "
                      r"once, got 0 for experts 3 and 4"] * 2,
    "map_length": [r"the ranks disagree on the number of experts \(expert_map's length\): "
                   r"rank 0 has 5, rank 1 has 6"] * 2,
    "count_vs_packed": [r"w4a8moe\.distributed: rank 1: w13_packed: expected the shard's 2 "
                        r"local experts \(expert_map\), got 1"] * 2,
    "hidden_size": [r"the ranks disagree on the hidden size: rank 0 has 128, rank 1 has 256"] * 2,
    "activation": [r"the ranks disagree on the activation: rank 0 has 2, rank 1 has 3"] * 2,
    "exact": [r"the ranks disagree on exact results: rank 0 has False, rank 1 has True"] * 2,
    "exact_bf16": [r"w4a8moe\.distributed: rank 0: result_dtype: expected torch\.float32 with "
                   r"exact results \(a row per slot\), got torch\.bfloat16"] * 2,
    "exact_all_reduce": [r"w4a8moe\.distributed: rank 0: exact: expected mode 'dispatch' \(the "
                         r"all_reduce way adds the ranks' partial sums\), got 'all_reduce'"] * 2,
    "bad_ids_all_reduce": [r"w4a8moe\.distributed: 1 other rank\(s\) refused their input",
                           r"topk_ids: expected expert ids in \[0, 5\), got 5 at token 3, slot 1"],
    "bad_ids_dispatch": [r"w4a8moe\.distributed: rank\(s\) 1 refused their input to dispatch",
                         r"topk_ids: expected expert ids in \[0, 5\), got 5 at token 3, slot 1"],
    "top_k_dispatch": [r"the ranks disagree on top_k: rank 0 has 2, rank 1 has 1"] * 2,
    "still_usable": [None, None],
}


def scenario_errors(rank):
    return {name: bad_case(name, rank) for name in BAD_CASES}


SCENARIOS = {"layers": scenario_layers, "errors": scenario_errors}


def rank_main(scenario, rank, ranks, port, out_path):
    torch.set_num_threads(1)
    w4a8moe.set_num_threads(1)  # two ranks on a CI machine of two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(SCENARIOS[scenario](rank), out_path)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The tests (the parent process)

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario, folder):
    """Runs `scenario` on RANKS processes; returns what each rank saved. Fails (instead of
    hanging) when they do not finish within LAUNCH_TIMEOUT."""
    port = free_port()
    outs = [os.path.join(folder, f"{scenario}-{r}.pt") for r in range(RANKS)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), scenario, str(r),
                               str(RANKS), str(port), outs[r]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(RANKS)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=LAUNCH_TIMEOUT)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario}: the ranks did not finish within {LAUNCH_TIMEOUT} s (a hang)")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"{scenario}: rank {r} exited with {p.returncode}:\n{logs[r]}"
    return [torch.load(o) for o in outs]


if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    return launch("layers", str(tmp_path_factory.mktemp("ep")))


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    return launch("errors", str(tmp_path_factory.mktemp("ep")))


def close_to(got, want, rtol):
    """|got - want| <= rtol * max |want| of the row, plus rounding to got's dtype; want of
    order one."""
    assert got.shape == want.shape and got.dtype == want.dtype
    want64, got64 = want.double(), got.double()
    size = want64.pow(2).mean().sqrt().item()
    assert 0.1 < size < 10, f"reference RMS {size:.3g} is not of order one"
    row = want64.abs().amax(dim=1, keepdim=True)
    ulp = 0.0 if want.dtype == torch.float32 else 2.0 * torch.finfo(want.dtype).eps
    err = (got64 - want64).abs() - (rtol * row + ulp * want64.abs())
    worst = err.max().item()
    assert worst <= 0, f"error exceeds the bound by {worst:.3g} (row max {row.max().item():.3g})"


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16) if a.dtype != torch.float32 else a.view(torch.int32),
        b.view(torch.int16) if b.dtype != torch.float32 else b.view(torch.int32))


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_both_ways_match_one_process(layers, name):
    spec = spec_of(name)
    single = layers[0][name]["single"]
    assert same_bits(single, layers[1][name]["single"])
    # all_reduce: every rank has the whole output, the same bits, run after run
    a = layers[0][name]["all_reduce-float32"]
    assert same_bits(a[0], a[1]) and same_bits(a[0], layers[1][name]["all_reduce-float32"][0])
    close_to(a[0], single, 1e-6)
    starts = token_starts(spec)
    # dispatch: each rank its own tokens; with exact results the single-process bits
    for key, rtol in (("dispatch-float32", 1e-6),
                      ("dispatch-bfloat16", math.ldexp(1.0, -8) * spec["K"]),
                      ("dispatch-exact", None)):
        parts = [layers[r][name][key] for r in range(RANKS)]
        for r in range(RANKS):
            assert parts[r][0].shape == (starts[r + 1] - starts[r], H)
            assert same_bits(parts[r][0], parts[r][1]), f"{key}: rank {r} differs between runs"
        whole = torch.cat([p[0] for p in parts])
        if rtol is None:
            assert same_bits(whole, single), f"{key}: not the single-process bits"
        else:
            close_to(whole, single, rtol)


def test_all_experts_elsewhere_is_not_zero(layers):
    """Token 0 chose only rank 1's experts: its row comes entirely from the other rank."""
    single = layers[0]["all_experts_elsewhere"]["single"]
    assert single[0].abs().max() > 0.1
    assert same_bits(layers[0]["all_experts_elsewhere"]["dispatch-float32"][0][0], single[0])


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_input_fails_on_every_rank(errors, name):
    for rank in range(RANKS):
        message, want = errors[rank][name], BAD_CASES[name][rank]
        if want is None:
            assert message is None, f"rank {rank}: {message}"
        else:
            assert message is not None, f"rank {rank}: no error"
            assert re.search(want, message), f"rank {rank}: {message!r} !~ {want!r}"


# ---------------------------------------------------------------------------------------------
# The ops in one process

@pytest.fixture(scope="module")
def small():
    weights = make_weights(5, I, H, G, 50, bias=True)
    x, ids, wts = make_inputs(9, H, 5, 2, 50)
    return weights, x, ids, wts


def test_packing_a_shard_is_packing_those_experts(small):
    weights = small[0]
    pick = [3, 0, 4]
    shard = weights.pack(experts=pick)
    sliced = w4a8moe.pack(weights.w13[pick], weights.w2[pick], weights.w13_scale[pick],
                          weights.w2_scale[pick], G, weights.w13_bias[pick],
                          weights.w2_bias[pick])
    for a, b in zip(shard, sliced):
        assert torch.equal(a, b)
    assert w4a8moe.packed_info(shard[0]).experts == 3
    with pytest.raises(RuntimeError, match="PackOptions::experts: expected each expert once, "
                                           "got 1 twice"):
        weights.pack(experts=[1, 1])
    with pytest.raises(RuntimeError, match=r"PackOptions::experts: expected expert indices in "
                                           r"\[0, 5\) \(the tensors' experts\), got 5"):
        weights.pack(experts=[0, 5])


def test_forward_local_partial_sums_add_up(small):
    weights, x, ids, wts = small
    ids = ids.clone()
    ids[0], ids[1] = torch.tensor([3, 4]), torch.tensor([0, 1])  # only rank 1's, only rank 0's
    single = w4a8moe.moe(x, ids, wts, *weights.pack())
    total = torch.zeros_like(single)
    for rank in range(RANKS):
        emap = ep.even_split_expert_map(5, rank, RANKS)
        packed = weights.pack(experts=ep.shard_experts(emap).tolist())
        part = w4a8moe.ops.forward_local(x, ids, wts, *packed, emap, False, 2, 1.702, 7.0, True)
        assert part.dtype == torch.float32
        total += part
        local = (emap[ids] >= 0).any(dim=1)  # tokens with no local expert: zeros
        assert torch.all(part[~local] == 0) and local.any() and not local.all()
    close_to(total, single, 1e-6)
    bf = w4a8moe.ops.forward_local(x.bfloat16(), ids, wts, *packed, emap)
    assert bf.dtype == torch.bfloat16 and bf.shape == x.shape


def test_forward_local_errors(small):
    weights, x, ids, wts = small
    emap = ep.even_split_expert_map(5, 0, RANKS)  # experts 0, 1, 2
    packed = weights.pack(experts=[0, 1])
    with pytest.raises(RuntimeError, match="w13_packed: expected the shard's 3 local experts, "
                                           "got 2"):
        w4a8moe.ops.forward_local(x, ids, wts, *packed, emap)
    with pytest.raises(RuntimeError, match=r"expert_map: expected an int32 tensor \[E\]"):
        w4a8moe.ops.forward_local(x, ids, wts, *packed, emap.long())
    with pytest.raises(RuntimeError, match="expert_map: expected at least one local expert"):
        ep.shard_experts(torch.full((5,), -1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"shards: .*got expert 1 held by none"):
        w4a8moe.ops.expert_owners(torch.tensor([[0, -1, -1], [-1, -1, 0]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"expert_maps\[1\]: expected at least one local "
                                           r"expert, got none"):
        w4a8moe.ops.expert_owners(torch.tensor([[0, 1, 2], [-1, -1, -1]], dtype=torch.int32))
    assert w4a8moe.ops.expert_owners(
        torch.tensor([[0, -1, 1], [-1, 0, -1]], dtype=torch.int32)).tolist() == [0, 1, 0]


def test_forward_local_shape_function(small):
    weights, x, ids, wts = small
    emap = ep.even_split_expert_map(5, 0, RANKS)
    packed = weights.pack(experts=[0, 1, 2])
    meta = [t.to("meta") for t in (x, ids, wts, *packed, emap)]
    out = w4a8moe.ops.forward_local(*meta, False, 2, 1.702, 7.0, True)
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"topk_weights: expected shape \[9, 2\]"):
        w4a8moe.ops.forward_local(meta[0], meta[1], meta[2][:, :1], *meta[3:])


def test_packing_shape_function(small):
    weights = small[0]
    experts = torch.tensor([3, 0, 4])
    args = (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale, G, experts,
            weights.w13_bias, weights.w2_bias)
    real = torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format_shard(*args)
    meta = torch.ops.w4a8moe.convert_to_w4a8_int8_moe_format_shard(
        *[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    assert [m.shape for m in meta] == [r.shape for r in real]


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck: torch 2")
def test_opcheck_forward_local(small):
    """The shard packing op is left out: its Meta kernel takes the experts' count from a
    tensor, which opcheck's dynamic-shape pass makes symbolic (test_packing_shape_function
    covers meta tensors)."""
    weights, x, ids, wts = small
    emap = ep.even_split_expert_map(5, 1, RANKS)
    experts = ep.shard_experts(emap)
    packed = weights.pack(experts=experts.tolist())
    for dtype, f32_output in ((torch.float32, False), (torch.bfloat16, True)):
        torch.library.opcheck(torch.ops.w4a8moe.forward_local.default,
                              (x.to(dtype), ids, wts, *packed, emap, True, 1, 1.5, 6.0,
                               f32_output))


def test_dispatch_class_errors():
    maps = torch.stack([ep.even_split_expert_map(4, r, RANKS) for r in range(RANKS)])
    with pytest.raises(RuntimeError, match="result_dtype: expected 'f32' or 'bf16', got 'f16'"):
        torch.classes.w4a8moe.Dispatch(maps, 0, H, 2, False, 2, 1.702, 7.0, "f16")
    with pytest.raises(RuntimeError, match=r"rank: expected a process in \[0, 2\), got 2"):
        torch.classes.w4a8moe.Dispatch(maps, 2, H, 2, False, 2, 1.702, 7.0, "f32")
    with pytest.raises(RuntimeError, match=r"result_dtype: expected f32 with exact results \(a "
                                           r"row per slot\), got bf16"):
        torch.classes.w4a8moe.Dispatch(maps, 0, H, 2, False, 2, 1.702, 7.0, "bf16", True)
    d = torch.classes.w4a8moe.Dispatch(maps, 0, H, 2, False, 2, 1.702, 7.0, "bf16")
    assert d.ranks() == 2 and d.result_row_bytes() == 2 * H and not d.exact()
    with pytest.raises(RuntimeError, match=r"returned: expected 0 result rows"):
        d.combine(torch.zeros(8, dtype=torch.uint8))


@pytest.mark.parametrize("exact", [False, True])
def test_dispatch_class_in_one_process(small, exact):
    """Two ranks' Dispatch objects, the exchange done by hand: the row counts of the way back
    match between sender and receiver (a row per record, or with exact results a row per slot
    held by the computing rank), and exact results give the single-process bits."""
    weights, x, ids, wts = small
    maps = torch.stack([ep.even_split_expert_map(5, r, RANKS) for r in range(RANKS)])
    packed = [weights.pack(experts=ep.shard_experts(maps[r]).tolist()) for r in range(RANKS)]
    d = [torch.classes.w4a8moe.Dispatch(maps, r, H, 2, False, 2, 1.702, 7.0, "f32", exact)
         for r in range(RANKS)]
    starts = [0, 4, 9]
    sent = [d[r].pack(*(t[starts[r]:starts[r + 1]] for t in (x, ids, wts))) for r in range(RANKS)]
    rb, row = d[0].record_bytes(), d[0].result_row_bytes()
    results = []
    for s in range(RANKS):  # the records for rank s, from each rank in rank order
        counts = torch.stack([sent[r][0][s] for r in range(RANKS)])
        received = torch.cat([sent[r][1][sum(sent[r][0][:s]) * rb:][:sent[r][0][s] * rb]
                              for r in range(RANKS)])
        results.append(d[s].compute(received, counts, *packed[s]))
        held = (maps[s][ids] >= 0).long()  # slots of each token held by rank s
        for r in range(RANKS):
            mine = held[starts[r]:starts[r + 1]]
            want = mine.sum() if exact else (mine.sum(dim=1) > 0).sum()
            assert d[s].result_counts()[r].item() == want.item()
            assert d[r].returned_counts()[s].item() == want.item()
    out = []
    for r in range(RANKS):  # the rows for rank r, from each rank in rank order
        returned = torch.cat([
            results[s][sum(d[s].result_counts()[:r]) * row:][:d[s].result_counts()[r] * row]
            for s in range(RANKS)])
        out.append(d[r].combine(returned))
    single = w4a8moe.moe(x, ids, wts, *weights.pack())
    if exact:
        assert d[0].exact() and same_bits(torch.cat(out), single)
    else:
        close_to(torch.cat(out), single, 1e-6)


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
