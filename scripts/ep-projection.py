#!/usr/bin/env python3
"""Expert parallelism on paper: memory, bytes sent and time per MoE layer on N machines.

    python3 scripts/ep-projection.py             # the tables of docs/expert-parallel-projection.md
    python3 scripts/ep-projection.py --check docs/expert-parallel-projection.md
    python3 scripts/ep-projection.py --link-gbps 10,25,100,400 --latency-us 5

A projection, not a measurement: the models, the formulas and the measured inputs they scale are
in docs/expert-parallel-projection.md. Python 3 standard library only.
"""

import argparse
import math
import sys

# name, MoE layers, routed experts E, hidden H, intermediate I, top-k K
MODELS = [
    ("DeepSeek-V3", 58, 256, 7168, 2048, 8),
    ("Qwen3-235B-A22B", 94, 128, 4096, 1536, 8),
]

# The point whose MAC rate prefill scales: Qwen3-30B-A3B (H 2048, I 768, top-8), 512 tokens.
MEASURED_H, MEASURED_I, MEASURED_K, MEASURED_TOKENS = 2048, 768, 8, 512
MEASURED_MACS = 3 * MEASURED_H * MEASURED_I * MEASURED_K * MEASURED_TOKENS

GROUP = 32  # bf16 scales, one per 32 weights of a row


def packed_matrix_bytes(rows, cols):
    """int4 weights, one bf16 scale per GROUP columns of a row, one 4-byte correction per row."""
    return rows * cols // 2 + rows * (cols // GROUP) * 2 + rows * 4


def expert_bytes(h, i):
    return packed_matrix_bytes(2 * i, h) + packed_matrix_bytes(h, i)


def shares(experts, machines):
    """Contiguous, as even as possible: the first E mod N ranks hold one more."""
    base, extra = divmod(experts, machines)
    return [base + (1 if rank < extra else 0) for rank in range(machines)]


def hit_probability(experts, k, held):
    """P(a token's K distinct experts, drawn uniformly from E, include one of `held` of them)."""
    return 1.0 - math.comb(experts - held, k) / math.comb(experts, k)


def rank_loads(model, machines, tokens_per_process, p, link_gbps):
    """Per rank: compute seconds and its bound, and for each combine way (bytes sent, seconds)."""
    _, _, e, h, i, k = model
    share = shares(e, machines)
    tokens = tokens_per_process * machines  # the layer's whole batch, the same in both ways
    bw = link_gbps * 1e9 / 8  # bytes/s of one direction of a full-duplex link
    lat = p.latency_us * 1e-6
    # a record: 16-byte head (token, slots, f32 scale, int32 zero point), K int32 ids and K f32
    # weights, the H int8 values, padded to 16 bytes (docs/expert-parallel.md, "Records")
    row = (16 + 8 * k + h + 15) // 16 * 16
    loads = []
    for rank, held in enumerate(share):
        touched = held * (1.0 - (1.0 - k / e) ** tokens)
        read_s = touched * expert_bytes(h, i) / (p.read_gbs * 1e9 * p.decode_fraction)
        mac_s = tokens * k * held / e * 3 * h * i / (p.gmacs * 1e9)
        load = {"compute": max(read_s, mac_s), "bound": "bytes" if read_s >= mac_s else "MACs"}
        ar_sent = 2 * (machines - 1) / machines * tokens * h * 4
        load["all-reduce"] = (ar_sent, 2 * (machines - 1) * lat + ar_sent / bw)
        # rows this rank dispatches (its tokens, once per other rank they reach), and receives
        rows_out = tokens_per_process * sum(
            hit_probability(e, k, other) for q, other in enumerate(share) if q != rank
        )
        rows_in = tokens_per_process * (machines - 1) * hit_probability(e, k, held)
        load["rows_out"] = rows_out
        for way, ret in (("f32", 4 * h), ("bf16", 2 * h)):
            sent = rows_out * row + rows_in * ret  # dispatch out, then combine out
            # two all-to-alls of N-1 pairwise rounds; each as long as the larger of in and out
            wire = max(rows_out, rows_in) * (row + ret)
            load[way] = (sent, 2 * (machines - 1) * lat + wire / bw)
        loads.append(load)
    return loads


def fmt_bytes(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ms(seconds):
    return f"{seconds * 1e3:.3f}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


WAYS = ["all-reduce", "f32", "bf16"]


def phases(p):
    return [("decode", p.decode_tokens), ("prefill", p.prefill_tokens)]


def render(p):
    parts = ["### Inputs (projection)\n\n"]
    inputs = [
        ["read bandwidth of one machine (measured, 2-core host)", f"{p.read_gbs:g} GB/s"],
        ["fraction of it decode reaches (measured, 1 token)", f"{p.decode_fraction:.0%}"],
        ["decode weight stream", f"{p.read_gbs * p.decode_fraction:.1f} GB/s"],
        [
            "Qwen3-30B-A3B, 512 tokens (measured)",
            f"{p.prefill_ms:g} ms for {MEASURED_MACS / 1e9:.2f} GMAC",
        ],
        ["prefill MAC rate of one machine", f"{p.gmacs:.0f} GMAC/s"],
        ["tokens per machine", f"decode {p.decode_tokens}, prefill {p.prefill_tokens}"],
        ["links", ", ".join(f"{g:g} Gb/s" for g in p.links)],
        ["latency per message", f"{p.latency_us:g} us"],
    ]
    inputs += [
        [
            f"{name} ({layers} MoE layers, E {e}, H {h}, I {i}, K {k}): bytes per expert",
            fmt_bytes(expert_bytes(h, i)),
        ]
        for name, layers, e, h, i, k in MODELS
    ]
    parts.append(table(["quantity", "value"], inputs))

    rows = []
    for name, layers, e, h, i, _ in MODELS:
        for n in p.machines:
            held = shares(e, n)[0]
            per_layer = held * expert_bytes(h, i)
            total = f"{per_layer * layers / 1e9:.1f} GB"
            rows.append([name, str(n), str(held), fmt_bytes(per_layer), total])
    parts.append("\n\n### Memory per machine (projection)\n\n")
    parts.append(
        table(["model", "machines", "experts per machine", "per layer", "all MoE layers"], rows)
    )

    rows = []
    for model in MODELS:
        for phase, tpp in phases(p):
            for n in p.machines:
                loads = rank_loads(model, n, tpp, p, p.links[0])  # bytes: any link
                remote = max(l["rows_out"] for l in loads) / tpp
                sent = [fmt_bytes(max(l[way][0] for l in loads)) for way in WAYS]
                cells = [model[0], phase, str(n), str(tpp * n), f"{remote:.2f}"]
                rows.append(cells + sent + [str(2 * (n - 1))])
    parts.append("\n\n### Bytes each machine sends per layer (projection)\n\n")
    header = ["model", "phase", "machines", "tokens in the layer", "remote machines per token"]
    header += ["all-reduce", "dispatch/combine, f32 return", "dispatch/combine, bf16 return"]
    header += ["messages sent per machine"]
    parts.append(table(header, rows))

    header = ["model", "phase", "machines", "compute", "bound"]
    for way in ["all-reduce", "f32 return", "bf16 return"]:
        header += [f"{way} comm", f"{way} total / overlapped"]
    for gbps in p.links:
        rows = []
        for model in MODELS:
            for phase, tpp in phases(p):
                for n in p.machines:
                    loads = rank_loads(model, n, tpp, p, gbps)
                    slowest = max(loads, key=lambda l: l["compute"])
                    cells = [model[0], phase, str(n), fmt_ms(slowest["compute"]), slowest["bound"]]
                    for way in WAYS:
                        comm = max(l[way][1] for l in loads)
                        serial = max(l["compute"] + l[way][1] for l in loads)
                        overlapped = max(max(l["compute"], l[way][1]) for l in loads)
                        cells += [fmt_ms(comm), f"{fmt_ms(serial)} / {fmt_ms(overlapped)}"]
                    rows.append(cells)
        parts.append(
            f"\n\n### Time per layer, {gbps:g} Gb/s links, {p.latency_us:g} us per message, "
            "ms (projection)\n\n"
        )
        parts.append(table(header, rows))
    return "".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", default="1,2,4,8", help="comma-separated N (default 1,2,4,8)")
    ap.add_argument("--link-gbps", default="25,100", help="link speeds in Gb/s (default 25,100)")
    ap.add_argument("--latency-us", type=float, default=10.0, help="per message (default 10)")
    ap.add_argument(
        "--read-gbs", type=float, default=32.0, help="read bandwidth, GB/s (default 32)"
    )
    ap.add_argument(
        "--decode-fraction",
        type=float,
        default=0.65,
        help="fraction of the read bandwidth decode reaches (default 0.65)",
    )
    ap.add_argument(
        "--prefill-ms",
        type=float,
        default=48.2,
        help="measured Qwen3-30B-A3B time at 512 tokens, ms (default 48.2)",
    )
    ap.add_argument("--decode-tokens", type=int, default=1, help="per machine (default 1)")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="per machine (default 512)")
    ap.add_argument("--check", metavar="DOC", help="exit 1 unless DOC holds the output verbatim")
    p = ap.parse_args()
    p.machines = [int(v) for v in p.machines.split(",")]
    p.links = [float(v) for v in p.link_gbps.split(",")]
    if min(p.machines + [p.decode_tokens, p.prefill_tokens]) < 1 or min(p.links) <= 0:
        ap.error("machines and tokens must be at least 1, link speeds positive")
    p.gmacs = MEASURED_MACS / (p.prefill_ms * 1e-3) / 1e9
    text = render(p)
    if p.check:
        with open(p.check, encoding="utf-8") as f:
            if text not in f.read():
                print(f"{p.check} does not hold this script's output verbatim", file=sys.stderr)
                return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
