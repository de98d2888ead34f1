"""The test grid of vLLM's dynamic 4-bit int MoE CPU path (168 cases) against the plain-torch
reference, with data whose outputs are of order one and tolerances that a zero output or a wrong
activation fails."""

import functools

import pytest
import torch

import w4a8moe
from moe_data import assert_differs, assert_matches, make_inputs, make_weights

NUM_TOKENS = [1, 2, 64, 128]
# (intermediate I, hidden H, experts E, top-k, group size g), as in vLLM's test
MOE_CONFIGS = [
    (256, 512, 8, 2, 128),
    (256, 512, 8, 2, 64),
    (256, 512, 8, 2, -1),
    (512, 256, 8, 4, 128),
    (512, 512, 8, 2, 128),
    (768, 2048, 8, 2, 128),
    (768, 2048, 16, 4, 64),
]
SEEDS = [0, 42]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Ordered so that the cases sharing weights run one after another (see packed_weights).
CASES = [
    pytest.param(cfg, seed, tokens, dtype,
                 id=f"I{cfg[0]}-H{cfg[1]}-E{cfg[2]}-k{cfg[3]}-g{cfg[4]}-seed{seed}-T{tokens}-"
                    f"{str(dtype).split('.')[1]}")
    for cfg in MOE_CONFIGS for seed in SEEDS for tokens in NUM_TOKENS for dtype in DTYPES
]


@functools.lru_cache(maxsize=1)
def packed_weights(cfg, seed):
    inter, hidden, experts, _, group = cfg
    weights = make_weights(experts, inter, hidden, group, seed)
    return weights, weights.pack()


def test_grid_size():
    assert len(CASES) == 168


@pytest.mark.parametrize("cfg,seed,tokens,dtype", CASES)
def test_original_grid(cfg, seed, tokens, dtype):
    inter, hidden, experts, top_k, group = cfg
    weights, (w13_packed, w2_packed) = packed_weights(cfg, seed)
    x, topk_ids, topk_weights = make_inputs(tokens, hidden, experts, top_k, seed, dtype)

    out = torch.ops.w4a8moe.dynamic_4bit_int_moe(
        x, topk_ids, topk_weights, w13_packed, w2_packed, hidden, inter, group, False,
        int(w4a8moe.Activation.SILU))
    ref = weights.reference(x, topk_ids, topk_weights, activation="silu")

    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert_matches(out, ref, f"seed {seed}")
    # Negative check: the tolerance tells SiLU from GELU (assert_matches checked a zero output).
    wrong = weights.reference(x, topk_ids, topk_weights, activation="gelu")
    assert_differs(out, wrong, f"GELU instead of SiLU, seed {seed}")
