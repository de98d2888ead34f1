#!/usr/bin/env python3
"""Two (or more) builds of `w4a8moe` in one run: every kernel set, weight format and token count
asked for, the builds in turn (A B A B ...) for several rounds, one markdown row per point.

Each run is `w4a8moe bench --json` (its own probes between its timed forwards); a run whose
all-thread MAC probe reaches less than `--min-scaling` times the one-thread probe (the host took a
core away) is run again, up to three times. A row gives each build's median over the rounds of
its runs' medians and fractions (of the int8 MAC peak from 128 tokens, of the read bandwidth
below), and the median and range of the per-round time ratios of the last build to the first.

  scripts/compare-builds.py old=/tmp/old/build/w4a8moe new=build/w4a8moe
  scripts/compare-builds.py old=... new=... --sets avx2 --tokens 512 --formats int4:32,mxfp4:32

docs/performance.md ("Prefill on AMD Zen 4") shows a table it printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(binary, isa, weights, group, tokens, repeat, min_scaling):
    env = dict(os.environ, W4A8MOE_ISA=isa)
    cmd = [binary, "bench", "--json", "--no-check", "--tokens", str(tokens), "--weights", weights,
           "--group", str(group), "--repeat", str(repeat)]
    for _ in range(3):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        j = json.loads(out.stdout)
        if j["mac_probe_scaling"] >= min_scaling:
            break
        print(f"  (degraded run, probe scaling {j['mac_probe_scaling']:.2f}: again)",
              file=sys.stderr)
    return j


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", help="name=path of a w4a8moe program")
    ap.add_argument("--sets", default="avx512vnni,avx2", help="kernel sets (W4A8MOE_ISA)")
    ap.add_argument("--formats", default="int4:32,int4:128,int4:-1,mxfp4:32,int4_zp:32",
                    help="weights:group pairs (group -1: channel-wise)")
    ap.add_argument("--tokens", default="1,8,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-scaling", type=float, default=1.75,
                    help="the all-thread over one-thread MAC probe a run must reach")
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.builds]
    names = [n for n, _ in builds]
    points = [(s, f.split(":")[0], int(f.split(":")[1]), int(t)) for s in a.sets.split(",")
              for f in a.formats.split(",") for t in a.tokens.split(",")]
    results = {}
    for r in range(a.rounds):
        for p in points:
            isa, weights, group, tokens = p
            repeat = 20 if tokens <= 8 else 8
            for name, binary in builds:
                j = run(binary, isa, weights, group, tokens, repeat, a.min_scaling)
                results.setdefault((p, name), []).append(j)
                print(f"round {r + 1}: {isa} {weights} g{group} T{tokens} {name}: "
                      f"{j['median_ms']:.3f} ms", file=sys.stderr, flush=True)
    head = " | ".join(f"{n} ms | {n} of limit" for n in names)
    print(f"| kernel set | weights | group | tokens | {head} | {names[-1]}/{names[0]} time |")
    print("|---|---|---|---|" + "---|---|" * len(names) + "---|")
    for p in points:
        isa, weights, group, tokens = p
        key = "mac_fraction" if tokens >= 128 else "bandwidth_fraction"
        cells = []
        for n in names:
            runs = results[(p, n)]
            cells.append(f"{statistics.median(j['median_ms'] for j in runs):.2f}")
            cells.append(f"{100 * statistics.median(j[key] for j in runs):.0f}%"
                         f" {'MAC' if key == 'mac_fraction' else 'BW'}")
        first, last = results[(p, names[0])], results[(p, names[-1])]
        ratios = [b["median_ms"] / f["median_ms"] for f, b in zip(first, last)]
        print(f"| {isa} | {weights} | {'channel' if group < 0 else group} | {tokens} | "
              f"{' | '.join(cells)} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
