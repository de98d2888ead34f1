"""zentorch's fused MoE op (AMD's PyTorch extension) on a w4a8moe preset's layer: the peer of
`w4a8moe bench` in bench/zentorch_vs_w4a8moe.py (docs/performance.md, "zentorch").

Runs in the venv of scripts/zentorch-env.sh (torch 2.14.0, zentorch 2.14.0.1):

    "$(scripts/zentorch-env.sh)/bin/python" bench/zentorch_moe.py --group 32 --tokens 1,8,512

The layer: the preset's shapes, int weights drawn uniformly over their range and scales
c * (0.5 + U(0, 1)), c chosen as in `w4a8moe bench` so that every stage is of order one; x is
N(0, 1) in bf16 (zentorch's quantizing path takes bf16 only). The regime follows from the weights
zentorch is given:
  DA8W4 (--regime da8w4)  signed int4, two per byte (element 2j in the low nibble), int8
                          [E, N, K/2], f32 scales [E, K/g, N] (channel-wise, --group -1: [E, 1, N])
  DA8W8 (--regime da8w8)  int8 [E, N, K], f32 scales [E, 1, N]
Activations are quantized by zentorch per token to symmetric int8.

Check, before the timing at each token count: the first call's output on up to 4 tokens against
two references computed here from the unpacked weights in float64:
  emulated  the same regime: each token's input and intermediate (rounded to bf16 first)
            quantized per row to symmetric int8; bound CHECK_EMULATED
  float     no activation quantization (dequantized weights only); bound CHECK_FLOAT
Any failure exits with status 1 and says which. --self-test gives zentorch one expert with its
down-projection scales 10% off and succeeds only if the check catches it.

Timing as `w4a8moe bench` does it (docs/performance.md, "How it is measured"): one warm-up call
(zentorch packs every expert then, into a cache keyed by the weight tensors), then --repeat
calls, each with its own uniform routing, each after reading twice the last-level cache through
(zentorch's packed copy is its own, so it cannot be flushed line by line as the CLI flushes its
weights); median and minimum. Prints one line per token count, or with --json one JSON object per
line (regime, group, tokens, threads, repeat, median_ms, min_ms, check errors).
"""
import argparse
import json
import statistics
import sys
import time

import torch

# The silu presets of `w4a8moe bench` (tools/w4a8moe/synthetic.cpp): hidden, intermediate,
# experts, top-k.
PRESETS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "qwen3.6-35b-a3b": (2048, 512, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "tiny": (256, 128, 8, 2),
}
# Normalised RMS error bounds, |out - ref| / |ref| over each checked token.
# emulated: zentorch rounds its output to bf16 (relative error up to 2^-9, RMS about 1.1e-3) and
# requantizes some intermediate values one int8 step apart from ours (its intermediate is not
# exactly ours): measured on the tiny preset, most tokens 1.4e-3 to 2.7e-3, about one in seven up
# to 1.1e-2. One expert of K off by 10% gives about 10% / sqrt(K): 3.5e-2 at K = 8.
CHECK_EMULATED = 2e-2
# float: symmetric int8 of a row of N(0, 1) values (max about 3.5) has a step of 3.5 / 127 and an
# error RMS of step / sqrt(12) = 0.8%, twice (input and intermediate, whose tail is heavier):
# measured 1.6e-2 to 1.8e-2. An all-zero output or a wrong packing gives about 1.
CHECK_FLOAT = 4e-2
CHECKED_TOKENS = 4


class Failure(Exception):
    """A step that failed, with a sentence saying which and why."""


def token_counts(text):
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive token counts separated by commas, got '{text}'")
    return counts


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--regime", default="da8w4", choices=("da8w4", "da8w8"))
    ap.add_argument("--group", type=int, default=32,
                    help="DA8W4 group size along the input (a multiple of 32), -1 channel-wise; "
                         "DA8W8: -1 only")
    ap.add_argument("--tokens", type=token_counts, default=[1, 8, 512])
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per token count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per token count")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--self-test", action="store_true",
                    help="corrupt one expert and succeed only if the check fails")
    a = ap.parse_args(argv)
    H, I, _, _ = PRESETS[a.preset]
    if a.regime == "da8w8" and a.group != -1:
        ap.error(f"--group: expected -1 with --regime da8w8 (one scale per row), got {a.group}")
    if a.group != -1 and (a.group % 32 or H % a.group or I % a.group):
        ap.error(f"--group: expected -1 or a multiple of 32 dividing {H} and {I} "
                 f"({a.preset}), got {a.group}")
    if a.repeat < 1 or a.threads < 1:
        ap.error(f"--repeat and --threads: expected positive counts, got {a.repeat} and "
                 f"{a.threads}")
    return a


def random_matrix(experts, rows, cols, group, bits, c, gen):
    """Int codes [E, rows, cols] (int8) and f32 scales [E, cols / group, rows]: c / sqrt(cols)
    times (0.5 + U) for int4, scaled down by the RMS of int8 codes against int4's for int8."""
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (experts, rows, cols), dtype=torch.int8, generator=gen)
    groups = 1 if group == -1 else cols // group
    size = c / cols ** 0.5 * (1.0 if bits == 4 else 4.6 / 73.9)
    scales = size * (0.5 + torch.rand(experts, groups, rows, generator=gen))
    return codes, scales


def pack_int4(codes):
    """Signed int4 codes [..., K] as zentorch's DA8W4 takes them: int8 [..., K/2], element 2j in
    the low nibble and 2j + 1 in the high one (two's complement)."""
    return ((codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)).to(torch.int8)


def make_layer(preset, regime, group, seed):
    """The layer's codes and scales (the truth the references read) and zentorch's tensors."""
    H, I, E, _ = PRESETS[preset]
    bits = 4 if regime == "da8w4" else 8
    gen = torch.Generator().manual_seed(seed)
    c13, s13 = random_matrix(E, 2 * I, H, group, bits, 0.3, gen)
    c2, s2 = random_matrix(E, H, I, group, bits, 0.4, gen)
    w13, w2 = (pack_int4(c13), pack_int4(c2)) if bits == 4 else (c13, c2)
    return {"codes13": c13, "scales13": s13, "codes2": c2, "scales2": s2,
            "zentorch": [w13, w2, s13, s2]}


def make_routing(tokens, experts, top_k, gen):
    """Uniform top-k without repeats per token (int32 ids), weights summing to one (f32)."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids.to(torch.int32), weights / weights.sum(dim=1, keepdim=True)


def run_zentorch(layer, x, routing):
    w13, w2, s13, s2 = layer["zentorch"]
    out = torch.empty_like(x)
    torch.ops.zentorch.zentorch_fused_moe(out, x, w13, w2, None, None, routing[1], routing[0],
                                          False, "silu", s13, s2)
    return out


def dequantize(codes, scales, expert):
    """One expert's weights [N, K] in float64 from codes [E, N, K] and scales [E, K/g, N]."""
    c = codes[expert].double()
    return c * scales[expert].double().t().repeat_interleave(c.shape[1] // scales.shape[1], 1)


def quant_row(a):
    """Symmetric int8 of one row with one scale (max |a| / 127), as zentorch's per-token
    quantization; returns the values it represents."""
    step = a.abs().max() / 127
    return a if step == 0 else torch.clamp(torch.round(a / step), -128, 127) * step


def reference(layer, x_row, ids, weights, emulate):
    """One token's output (float64): SUM_k w_k * W2 (silu(gate) * up), gate and up from W13 x;
    with emulate, x and the intermediate quantized as zentorch quantizes them."""
    inter = layer["codes2"].shape[2]
    out = torch.zeros(x_row.shape[0], dtype=torch.float64)
    a = quant_row(x_row.double()) if emulate else x_row.double()
    for e, w in zip(ids.tolist(), weights.double().tolist()):
        h = dequantize(layer["codes13"], layer["scales13"], e) @ a
        m = torch.nn.functional.silu(h[:inter]) * h[inter:]
        if emulate:
            m = quant_row(m.to(torch.bfloat16).double())
        out += w * (dequantize(layer["codes2"], layer["scales2"], e) @ m)
    return out


def check(layer, x, routing, out):
    """The largest normalised RMS error over up to CHECKED_TOKENS spread tokens, against the
    emulated and the float reference, and the largest |ref|."""
    T = x.shape[0]
    n = min(T, CHECKED_TOKENS)
    rows = [0] if n == 1 else [i * (T - 1) // (n - 1) for i in range(n)]
    errors = {"emulated": 0.0, "float": 0.0}
    top = 0.0
    for t in rows:
        got = out[t].double()
        for name in errors:
            ref = reference(layer, x[t], routing[0][t], routing[1][t], name == "emulated")
            err = ((got - ref).norm() / ref.norm()).item()
            errors[name] = max(errors[name], err)
            top = max(top, ref.abs().max().item())
    return errors, top


def check_failure(errors, top):
    """A sentence saying what failed, or None."""
    bad = [f"{name} reference: normalised RMS error {err:.2e} > {bound:.0e}"
           for (name, err), bound in zip(errors.items(), (CHECK_EMULATED, CHECK_FLOAT))
           if not err <= bound]
    if top < 0.1:
        bad.append(f"the reference's largest |value| is {top:.2e}: the data is not of order one")
    return "; ".join(bad) or None


def corrupt_one_expert(layer, expert):
    """zentorch's tensors with one expert's down-projection scales 10% larger (the truth kept)."""
    w13, w2, s13, s2 = layer["zentorch"]
    bad = s2.clone()
    bad[expert] *= 1.1
    torch.ops.zentorch.zentorch_flush_moe_weight_cache()  # its cache is keyed by pointer
    return dict(layer, zentorch=[w13, w2, s13, bad])


def self_test(layer, x, routings):
    routing = routings[0]
    bad = corrupt_one_expert(layer, int(routing[0][0, 0]))
    errors, top = check(layer, x, routing, run_zentorch(bad, x, routing))
    why = check_failure(errors, top)
    if why is None:
        raise Failure(f"self-test: one expert's scales 10% off passed the check ({errors}): the "
                      "check cannot catch such an error")
    print(f"self-test: the check caught the corrupted expert ({why})")


def llc_bytes():
    """The largest cache size in sysfs, as the CLI's eviction_bytes reads it (0 when unknown)."""
    largest = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        value = int(text.rstrip("KM") or 0) << {"K": 10, "M": 20}.get(text[-1:], 0)
        largest = max(largest, value)
    return largest


def time_calls(layer, x, routings):
    """Seconds of each call after the first (a warm-up), each after a read of twice the
    last-level cache (64 MiB to 2 GiB, as the CLI's eviction)."""
    evict_bytes = min(max(2 * llc_bytes(), 64 << 20), 2 << 30)
    evict = torch.ones(evict_bytes // 4, dtype=torch.float32)
    times = []
    for i, routing in enumerate(routings):
        evict.sum()
        t0 = time.perf_counter()
        run_zentorch(layer, x, routing)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def inputs(a, T, calls):
    """x [T, H] in bf16 and `calls` routings, from the seed and T."""
    H, _, E, K = PRESETS[a.preset]
    gen = torch.Generator().manual_seed(a.seed + T)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    return x, [make_routing(T, E, K, gen) for _ in range(calls)]


def measure(a, layer, T):
    """The check (unless --no-check) and the timing at T tokens: a dict for the report."""
    x, routings = inputs(a, T, a.repeat + 2)
    result = {"peer": "zentorch", "preset": a.preset, "regime": a.regime, "group": a.group,
              "tokens": T, "threads": a.threads, "repeat": a.repeat}
    if not a.no_check:
        errors, top = check(layer, x, routings[0], run_zentorch(layer, x, routings[0]))
        result.update(check_emulated=errors["emulated"], check_float=errors["float"],
                      check_max_abs_ref=top)
        why = check_failure(errors, top)
        if why:
            raise Failure(f"correctness check failed at {T} tokens ({a.regime}, group "
                          f"{a.group}): {why}")
    times = time_calls(layer, x, routings[1:])
    result.update(median_ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3)
    return result


def report(a, r):
    if a.json:
        print(json.dumps(r), flush=True)
        return
    checked = ("" if a.no_check else f", check: emulated {r['check_emulated']:.1e}, float "
               f"{r['check_float']:.1e}")
    print(f"zentorch {a.regime} group {a.group}, {a.preset}, {r['tokens']} tokens, "
          f"{a.threads} threads: median {r['median_ms']:.3f} ms, min {r['min_ms']:.3f} ms "
          f"({a.repeat} runs){checked}", flush=True)


def main(argv):
    a = parse_args(argv)
    import zentorch  # noqa: F401 (registers torch.ops.zentorch)
    torch.set_num_threads(a.threads)
    layer = make_layer(a.preset, a.regime, a.group, a.seed)
    try:
        if a.self_test:
            self_test(layer, *inputs(a, a.tokens[0], 1))
            return 0
        for T in a.tokens:
            report(a, measure(a, layer, T))
    except Failure as e:
        print(f"zentorch_moe.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
