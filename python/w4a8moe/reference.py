"""The operator's contract (docs/operator.md) in plain torch, for checking results.

Independent of the C++ library: it reads the logical (unpacked) weights, quantizes activations with
the formulas of docs/operator.md ("Activation quantization") in float32, computes the dot products
and activations in float64, and rounds to x's dtype at the end. Vectorised over tokens (one loop
over experts).
"""

import math

import torch

from ._activations import activation_code, code_error, is_code

__all__ = ["reference_moe", "quant_row", "dequantize_weights", "activate"]

def _activation_code(activation):
    code = activation_code(activation)
    if not is_code(code):
        raise ValueError(code_error(code))
    return code


def _round_half_away(v):
    """Round to nearest, ties away from zero (C's roundf), exactly: v - trunc(v) is exact, and
    twice it reaches +-1 exactly when the fraction is at least one half."""
    t = torch.trunc(v)
    return t + torch.trunc(2.0 * (v - t))


def quant_row(a):
    """Asymmetric int8 quantization of each row of `a` (docs/operator.md), in float32.

    Returns (q, zp, recip): q [P, K] int32 in [-128, 127], zp [P, 1] int32, recip [P, 1]
    float32, so that row p stands for (q[p] - zp[p]) * recip[p]. A row holding NaN or Inf gets
    recip NaN (its results become NaN; other rows are unaffected).
    """
    a = a.float()
    mn = a.amin(dim=1, keepdim=True)  # NaN and Inf propagate here
    mx = a.amax(dim=1, keepdim=True)
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    if not bool(finite.all()):
        a = torch.where(finite, a, torch.zeros_like(a))
        mn = torch.where(finite, mn, torch.zeros_like(mn))
        mx = torch.where(finite, mx, torch.zeros_like(mx))
    mn = mn.clamp(max=0.0)
    mx = mx.clamp(min=0.0)
    one = torch.ones_like(mn)
    s = torch.where(mx == mn, one, torch.full_like(mn, 255.0) / (mx - mn))
    s = torch.where(s <= torch.finfo(torch.float32).max, s, one)  # a denormal range quantizes to 0
    recip = one / s
    lo_err = (-128.0 + mn * s) + (127.0 + mx * s)
    zf = torch.where(lo_err > 0, -128.0 - mn * s, 127.0 - mx * s).clamp(-128.0, 127.0)
    zp = torch.round(zf)  # half to even
    q = (_round_half_away(a * s) + zp).clamp(-128.0, 127.0)
    recip = torch.where(finite, recip, torch.full_like(recip, math.nan))
    return q.to(torch.int32), zp.to(torch.int32), recip


def _int4_values(w):
    """int8 [..., K] in [-8, 7], or nibble-packed uint8 [..., K/2] -> int8 [..., K]."""
    if w.dtype == torch.uint8:
        lo = (w & 0x0F).to(torch.int8) - 8
        hi = (w >> 4).to(torch.int8) - 8
        return torch.stack((lo, hi), dim=-1).flatten(-2)
    if w.dtype != torch.int8:
        raise TypeError(f"weights: expected int8 or nibble-packed uint8, got {w.dtype}")
    return w


def dequantize_weights(w, scale, group_size):
    """Logical int4 weights and their scales -> float64 [E, N, K] (exact: int4 x scale)."""
    values = _int4_values(w).to(torch.float64)
    experts, rows, cols = values.shape
    groups = 1 if group_size == -1 else cols // group_size
    scale = scale.to(torch.float64).reshape(experts, rows, groups, 1)
    return (values.view(experts, rows, groups, cols // groups) * scale).view(experts, rows, cols)


def activate(gate, up, activation, alpha=1.702, limit=7.0):
    """The gated activation (docs/operator.md, "Activations") on float64 gate and up."""
    code = _activation_code(activation)
    if code == 0:  # swiglustep
        return torch.clamp(gate * torch.sigmoid(gate), max=limit) * up.clamp(-limit, limit)
    if code == 1:  # swigluoai
        gc = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1.0) * gc * torch.sigmoid(alpha * gc)
    if code == 2:  # silu
        return gate * torch.sigmoid(gate) * up
    if code == 3:  # gelu, exact erf form
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate * gate * gate)  # gelu_tanh
    return 0.5 * gate * (1.0 + torch.tanh(inner)) * up


def _group_dots(a, w, group_size):
    """Exact integer dot products per weight group: a [P, K] integer-valued (|a| <= 255), w
    [N, K] int8 -> [G, P, N] float64. Float32 products and sums of integers stay exact while
    every partial sum is below 2^24 (|w| <= 15: int4 less a zero point); larger groups use
    float64."""
    rows, cols = a.shape
    group = cols if group_size == -1 else group_size
    dtype = torch.float32 if 255 * 15 * group < 2**24 else torch.float64  # |w| <= 15
    a = a.to(dtype).view(rows, cols // group, group).transpose(0, 1)  # [G, P, g]
    w = w.to(dtype).view(w.shape[0], cols // group, group).permute(1, 2, 0)  # [G, g, N]
    return torch.bmm(a, w).to(torch.float64)


def _dq_dot(rows, w, scale, bias, group_size, quantize):
    """rows [P, K] float32 -> float64 [P, N] = dq_dot(quant_row(rows), w) + bias (docs/operator.md,
    "Weights and the dot product"): recip * SUM_b s[n, b] * SUM_{k in b} (q[k] - zp) * w[n, k],
    summed in float64. Without quantization, the float dot product with the dequantized weights."""
    if quantize:
        q, zp, recip = quant_row(rows)
        dots = _group_dots(q - zp, w, group_size)  # [G, P, N]
        scale = scale.to(torch.float64).reshape(w.shape[0], -1).T  # [G, N]
        h = (dots * scale[:, None, :]).sum(dim=0) * recip.to(torch.float64)
    else:
        h = rows.to(torch.float64) @ dequantize_weights(w[None], scale[None], group_size)[0].T
    return h if bias is None else h + bias.to(torch.float64)


def reference_moe(
    x,
    topk_ids,
    topk_weights,
    w13,
    w2,
    w13_scale,
    w2_scale,
    group_size,
    w13_bias=None,
    w2_bias=None,
    *,
    activation="silu",
    apply_router_weight_on_input=False,
    alpha=1.702,
    limit=7.0,
    gate_up_layout="halves",
    quantize_activations=True,
):
    """The MoE layer (docs/operator.md, "The forward pass") over the logical weights; returns
    [T, H] in x's dtype.

    w13 [E, 2I, H] and w2 [E, H, I]: int8 int4 values (or nibble-packed uint8 with half the
    last dimension); scales [E, N, K/g] (or [E, N] / [E, N, 1] when group_size is -1); biases
    [E, 2I] and [E, H] or None. activation: a name or the integer code. With
    quantize_activations=False it is the float reference of vLLM's test of its dynamic 4-bit int
    MoE CPU path (dequantized weights, no activation quantization).
    """
    if gate_up_layout not in ("halves", "interleaved"):
        raise ValueError(
            f"gate_up_layout: expected 'halves' or 'interleaved', got '{gate_up_layout}'")
    code = _activation_code(activation)
    # The op takes alpha and limit as float32.
    alpha = torch.tensor(alpha, dtype=torch.float32).item()
    limit = torch.tensor(limit, dtype=torch.float32).item()
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    experts, inter = w13.shape[0], w13.shape[1] // 2
    order = None  # rows of w13 in halves order
    if gate_up_layout == "interleaved":
        order = torch.cat((torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)))
        w13_bias = None if w13_bias is None else w13_bias[:, order]

    ids = topk_ids.reshape(-1).long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= experts):
        raise ValueError(f"topk_ids: expected expert ids in [0, {experts})")
    r = topk_weights.reshape(-1).float()
    token = torch.arange(tokens).repeat_interleave(top_k)
    rows = x.float()[token]
    if apply_router_weight_on_input:
        rows = rows * r[:, None]

    y = torch.zeros(tokens * top_k, hidden, dtype=torch.float64)
    for e in ids.unique().tolist():
        pairs = (ids == e).nonzero().flatten()
        b13 = None if w13_bias is None else w13_bias[e]
        b2 = None if w2_bias is None else w2_bias[e]
        w13_e, s13_e = _int4_values(w13[e]), w13_scale[e]
        if order is not None:
            w13_e, s13_e = w13_e[order], s13_e[order]
        h = _dq_dot(rows[pairs], w13_e, s13_e, b13, group_size, quantize_activations)
        m = activate(h[:, :inter], h[:, inter:], code, alpha, limit).float()
        y[pairs] = _dq_dot(m, _int4_values(w2[e]), w2_scale[e], b2, group_size,
                           quantize_activations)
    if not apply_router_weight_on_input:
        y = y * r.to(torch.float64)[:, None]
    # Slots in ascending order, as the contract sums them.
    out = y.view(tokens, top_k, hidden).sum(dim=1)
    return out.float().to(x.dtype)
