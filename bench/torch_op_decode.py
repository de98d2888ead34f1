"""The torch op at decode: on PyTorch's intra-op threads against the library's own, one process.

Times w4a8moe.moe on a synthetic layer of a preset's shape (g = 32, bf16 scales, f32 x, uniform
routing, a fresh routing per run, so that each run reads experts the last one did not), in four
ways:
  torch, after a torch op     the op on PyTorch's threads (w4a8moe.set_num_threads(0), the
                              default) right after a torch reduction over 256 MiB on the same
                              threads (the previous op of a model; it also evicts the weights)
  torch, back to back         the same, calls one after another
  own, after a torch op       the op on the library's own pool (w4a8moe.set_num_threads(n))
  own, back to back           the same, calls one after another (its workers still polling)
and prints the medians. Compare with `w4a8moe bench --spin-us 100000` (the C++ forward with
its workers awake) run beside it (docs/performance.md, "Threads at decode").

  PYTHONPATH=build/python python3 bench/torch_op_decode.py [--threads 2] [--tokens 1] [--runs 30]
"""
import argparse
import statistics
import time

import torch

import w4a8moe

SHAPES = {  # hidden, intermediate, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3.6-35b-a3b": (2048, 512, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--runs", type=int, default=30)
    a = ap.parse_args()
    H, I, E, K = SHAPES[a.preset]
    g = 32
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(1)
    w13 = torch.randint(-8, 8, (E, 2 * I, H), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-8, 8, (E, H, I), dtype=torch.int8, generator=gen)
    s13 = (torch.rand(E, 2 * I, H // g, generator=gen) * 0.02 + 0.01).bfloat16()
    s2 = (torch.rand(E, H, I // g, generator=gen) * 0.02 + 0.01).bfloat16()
    p13, p2 = w4a8moe.pack(w13, w2, s13, s2, group_size=g)
    del w13, w2
    x = torch.randn(a.tokens, H, generator=gen)
    flush = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB, past any last-level cache
    routings = []
    for _ in range(a.runs + 1):
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(a.tokens)])
        routings.append((ids.to(torch.int32), torch.full((a.tokens, K), 1.0 / K)))

    def time_runs(after_op):
        times = []
        for r in range(a.runs + 1):
            if after_op:
                flush.sum()
            ids, wts = routings[r]
            t0 = time.perf_counter()
            w4a8moe.moe(x, ids, wts, p13, p2)
            if r:  # the first run is a warm-up
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    rows = []
    for source, setting in (("torch", 0), ("own", a.threads)):
        w4a8moe.set_num_threads(setting)
        for after_op in (True, False):
            rows.append((source, after_op, time_runs(after_op)))
    print(f"{a.preset}, {a.tokens} token(s), {a.threads} threads, kernel set "
          f"{w4a8moe.active_kernel_set()}: median of {a.runs} runs, ms")
    for source, after_op, ms in rows:
        when = "after a torch op" if after_op else "back to back"
        print(f"  {source:5s} {when:16s} {ms:.3f}")

if __name__ == "__main__":
    main()
