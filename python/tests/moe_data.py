"""Test data whose outputs are of order one, and the comparison used by every accuracy test.

Weights: int4 values uniform in [-8, 7] (std 4.61), scales uniform in [0.5, 1.5] times
gain / (4.61 sqrt(K)), so that each projection keeps its input's magnitude times `gain`.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

import w4a8moe

INT4_STD = math.sqrt((16 * 16 - 1) / 12.0)


@dataclass
class Weights:
    w13: torch.Tensor  # [E, 2I, H] int8
    w2: torch.Tensor  # [E, H, I] int8
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    group_size: int
    w13_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None
    gate_up_layout: str = "halves"

    def pack(self, **options):
        return w4a8moe.pack(
            self.w13, self.w2, self.w13_scale, self.w2_scale, self.group_size,
            self.w13_bias, self.w2_bias, gate_up_layout=self.gate_up_layout, **options,
        )

    def reference(self, x, topk_ids, topk_weights, **kwargs):
        kwargs.setdefault("gate_up_layout", self.gate_up_layout)
        return w4a8moe.reference_moe(
            x, topk_ids, topk_weights, self.w13, self.w2, self.w13_scale, self.w2_scale,
            self.group_size, self.w13_bias, self.w2_bias, **kwargs,
        )


def make_weights(
    experts, inter, hidden, group_size, seed, *, scale_dtype=None, bias=False, gain13=1.5,
    gain2=1.0, gate_up_layout="halves",
):
    """Scales as vLLM's test of its dynamic 4-bit int MoE CPU path makes them unless scale_dtype
    is given: bfloat16 groupwise, float32 [E, N, 1] channelwise."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-8, 8, (experts, 2 * inter, hidden), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-8, 8, (experts, hidden, inter), dtype=torch.int8, generator=gen)
    if scale_dtype is None:
        scale_dtype = torch.float32 if group_size == -1 else torch.bfloat16

    def scales(rows, cols, gain):
        groups = 1 if group_size == -1 else cols // group_size
        s = (0.5 + torch.rand(experts, rows, groups, generator=gen)) * gain / (
            INT4_STD * math.sqrt(cols))
        return s.to(scale_dtype)

    w = Weights(w13, w2, scales(2 * inter, hidden, gain13), scales(hidden, inter, gain2),
                group_size, gate_up_layout=gate_up_layout)
    if bias:
        w.w13_bias = 0.5 * torch.randn(experts, 2 * inter, generator=gen)
        w.w2_bias = 0.5 * torch.randn(experts, hidden, generator=gen)
    return w


def make_inputs(tokens, hidden, experts, top_k, seed, dtype=torch.float32):
    """x [T, H] of order one; routing as vLLM's test of its dynamic 4-bit int MoE CPU path
    (softmax over the experts of bf16 scores, top-k, weights not renormalised)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    score = torch.randn(tokens, experts, generator=gen).to(torch.bfloat16)
    score = torch.softmax(score, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(score, top_k)
    return x, topk_ids.to(torch.long), topk_weights


def rms(t):
    return t.double().pow(2).mean().sqrt().item()


# Tolerances: relative to the reference's RMS, plus one unit in the last place of the output
# dtype (out and reference are both rounded to it). The loose bound, met by every element,
# allows the rare one-step difference in a requantized value (docs/operator.md, "Accuracy"):
# one step of the intermediate's quantization moves an output by r * step * |w| * s, up to about
# 1% of the RMS for these shapes. The tight bound is float rounding, met by 90% of the rows. A wrong
# activation moves outputs by 40% of the RMS or more, a zero output by 100%.
LOOSE = 2e-2
TIGHT = 2e-5


def bound(ref, rel):
    eps = torch.finfo(ref.dtype).eps
    return rel * rms(ref) + eps * ref.double().abs()


def mismatch(out, ref, tight=True):
    """Why out does not agree with the reference (None if it does): every element within the
    loose bound and, from 16 rows on (and unless tight is False), 90% of the rows within the
    tight one."""
    err = (out.double() - ref.double()).abs()
    worst = (err / bound(ref, LOOSE)).max().item()
    if worst > 1.0:
        return (f"max error {err.max().item():.3g} is {worst:.3g}x the tolerance "
                f"(reference RMS {rms(ref):.3g})")
    if tight and ref.shape[0] >= 16:
        tight_rows = (err <= bound(ref, TIGHT)).all(dim=1).double().mean().item()
        if tight_rows < 0.9:
            return f"only {tight_rows:.1%} of the rows are within float rounding"
    return None


def assert_matches(out, ref, what="", tight=True):
    """out agrees with the reference, which is of order one; a zero output would not pass."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    assert torch.isfinite(ref).all(), f"{what}: reference not finite"
    size = rms(ref)
    assert 0.1 < size < 10.0, f"{what}: reference RMS {size:.3g} is not of order one"
    why = mismatch(out, ref, tight)
    assert why is None, f"{what}: {why}"
    assert mismatch(torch.zeros_like(ref), ref) is not None, f"{what}: a zero output would pass"


def assert_differs(out, wrong, what="", tight=True):
    """Negative check: out does not pass for a reference computed with something wrong."""
    assert mismatch(out, wrong, tight) is not None, f"the output passes for {what}"
