#!/usr/bin/env python3
"""Per-call overhead of the torch op from Python, against the layer's time at 1 token.

    python scripts/call-overhead.py [--threads N] [--calls C]    (with w4a8moe importable)

Measures, each as the median of C calls:
  - empty:  T = 0 (argument checks, both packed headers checked, output allocated; no compute)
  - tiny:   T = 1 on a one-expert 32 x 32 layer (adds the context lease and waking the workers;
            the compute is a few hundred multiply-adds)
  - layer:  T = 1 on Qwen3-30B-A3B's MoE layer (H 2048, I 768, 128 experts, top-8, g = 32,
            bf16 scales), weights hot in cache after the first calls
for the raw op (torch.ops.w4a8moe.dynamic_4bit_int_moe), the package's w4a8moe.moe and the
drop-in w4a8moe.vllm.dynamic_4bit_int_moe. "tiny" is an upper bound of what a call adds around
the kernels; it is printed as a fraction of "layer" and of the C++ bench's 1-token median
(`w4a8moe bench --tokens 1`, cold weights), if given with --bench-ms.
"""

import argparse
import statistics
import time

import torch

import w4a8moe
import w4a8moe.vllm


def median_us(fn, calls):
    for _ in range(min(20, calls)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def layer(experts, inter, hidden, group, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-8, 8, (experts, 2 * inter, hidden), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-8, 8, (experts, hidden, inter), dtype=torch.int8, generator=gen)
    s13 = (torch.rand(experts, 2 * inter, hidden // group, generator=gen) * 0.01).bfloat16()
    s2 = (torch.rand(experts, hidden, inter // group, generator=gen) * 0.01).bfloat16()
    return w4a8moe.pack(w13, w2, s13, s2, group)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--bench-ms", type=float, default=None,
                    help="the C++ bench's 1-token median in ms, to compare with")
    a = ap.parse_args()
    w4a8moe.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, kernel set {w4a8moe.active_kernel_set()}, "
          f"{a.threads} threads")

    results = {}
    for name, (E, I, H, K, g) in {"tiny": (1, 32, 32, 1, 32),
                                   "layer": (128, 768, 2048, 8, 32)}.items():
        p13, p2 = layer(E, I, H, g, 1)
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(0, E, (1, K), generator=gen)
        wts = torch.rand(1, K, generator=gen)
        x = torch.randn(1, H, generator=gen)
        op = torch.ops.w4a8moe.dynamic_4bit_int_moe
        calls = {
            "raw op": lambda: op(x, ids, wts, p13, p2, H, I, g, False, 2),
            "w4a8moe.moe": lambda: w4a8moe.moe(x, ids, wts, p13, p2, hidden_size=H,
                                               intermediate_size=I, group_size=g),
            "w4a8moe.vllm": lambda: w4a8moe.vllm.dynamic_4bit_int_moe(
                x, ids, wts, p13, p2, H, I, g, False, 2),
        }
        if name == "tiny":
            x0, ids0, wts0 = x[:0], ids[:0], wts[:0]
            results["empty"] = {"raw op": median_us(
                lambda: op(x0, ids0, wts0, p13, p2, H, I, g, False, 2), a.calls)}
        results[name] = {k: median_us(f, a.calls if name == "tiny" else a.calls // 5)
                         for k, f in calls.items()}
    for name, row in results.items():
        print(f"{name:6s} " + "  ".join(f"{k} {v:8.1f} us" for k, v in row.items()))
    for k in results["tiny"]:
        frac = results["tiny"][k] / results["layer"][k]
        line = f"overhead bound ({k}): {results['tiny'][k]:.1f} us = {frac:.1%} of the hot layer"
        if a.bench_ms:
            line += f", {results['tiny'][k] / (a.bench_ms * 1e3):.1%} of the bench's {a.bench_ms} ms"
        print(line)


if __name__ == "__main__":
    main()
