"""Packing one MoE layer from an engine's checkpoint tensors, as the vLLM plugin does at load:
Qwen3-30B-A3B's from GPTQ (E 128, H 2048, I 768, group 128: w4a8moe.vllm.pack_gptq_moe) and
gpt-oss-20b's from MXFP4 (E 32, H 2880, I 2880: pack_mxfp4_moe), random words; the median and
minimum of --repeat runs. Compares two builds of the package when run with each in turn.

    python bench/pack_layers.py --repeat 5
"""

import argparse
import statistics
import time

import torch

from w4a8moe.vllm import pack_gptq_moe, pack_mxfp4_moe


def timed(f, repeat):
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        f()
        times.append(time.perf_counter() - begin)
    return statistics.median(times), min(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32)  # noqa
    E, H, I, g = 128, 2048, 768, 128
    q13, q2 = words(E, H // 8, 2 * I), words(E, I // 8, H)
    s13, s2 = torch.rand(E, H // g, 2 * I) / 100, torch.rand(E, I // g, H) / 100
    median, best = timed(lambda: pack_gptq_moe(q13, q2, s13, s2, g), args.repeat)
    print(f"Qwen3-30B-A3B layer, GPTQ: median {median:.3f} s, min {best:.3f} s")
    E, H, I = 32, 2880, 2880
    codes = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8)  # noqa
    c13, c2 = codes(E, 2 * I, H // 2), codes(E, H, I // 2)
    e13 = torch.randint(120, 130, (E, 2 * I, H // 32), dtype=torch.uint8)
    e2 = torch.randint(120, 130, (E, H, I // 32), dtype=torch.uint8)
    median, best = timed(lambda: pack_mxfp4_moe(c13, c2, e13, e2), args.repeat)
    print(f"gpt-oss-20b layer, MXFP4: median {median:.3f} s, min {best:.3f} s")


if __name__ == "__main__":
    main()
