"""w4a8moe against zentorch's fused MoE op, in one run: `w4a8moe bench` and bench/zentorch_moe.py
(in the venv of scripts/zentorch-env.sh, filled on first use) take turns, config by config and
round by round, on the same preset, group sizes, token counts and threads; then one Markdown
table (docs/performance.md, "zentorch").

    python3 bench/zentorch_vs_w4a8moe.py --w4a8moe build/w4a8moe [--rounds 2] [--repeat 10]

Both get bf16 x (zentorch's quantizing path takes nothing else) and f32 scales; w4a8moe's own
check against its reference and zentorch_moe.py's check run in every process, and a failure of
either stops the run. zentorch's DA8W8 (int8 weights, one scale per row) has no w4a8moe twin: its
rows are set against w4a8moe's channel-wise int4.

On a shared host, --max-load L waits before each process (polling every 30 s, up to --max-wait
minutes) until the 1-minute load average is below L and no --wait-while file exists; a process
that started without that quiet is marked "contended" in the table, as is one during which other
processes took over a quarter of the CPUs (the last column: the most of any run of the row, from
/proc/stat less this run's own CPU time) or whose MAC probe said the host took a core away.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Failure(Exception):
    """A step that failed, with a sentence saying which and why."""


def int_list(text):
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got '{text}'") from None


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--w4a8moe", default=os.path.join(ROOT, "build", "w4a8moe"),
                    help="the w4a8moe program (default build/w4a8moe)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--groups", type=int_list, default=[32, 128, -1],
                    help="DA8W4 group sizes, -1 channel-wise")
    ap.add_argument("--no-da8w8", action="store_true", help="leave out zentorch's int8 weights")
    ap.add_argument("--tokens", type=int_list, default=[1, 8, 512])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per process and count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin-us", type=int,
                    help="w4a8moe bench --spin-us: how long its idle workers poll (default: the "
                         "library's); zentorch's calls start right after the eviction read, which "
                         "runs on the same OpenMP threads")
    ap.add_argument("--max-load", type=float, default=0.0,
                    help="wait for a 1-minute load average below this (0: no wait)")
    ap.add_argument("--wait-while", action="append", default=[], metavar="FILE",
                    help="with --max-load: also wait while FILE exists (repeatable)")
    ap.add_argument("--max-wait", type=float, default=40.0, help="minutes, per wait")
    ap.add_argument("--log", help="append every process's JSON result to this file")
    ap.add_argument("--table-from", metavar="LOG", help="measure nothing: the table of a --log")
    a = ap.parse_args(argv)
    if not a.table_from and not os.access(a.w4a8moe, os.X_OK):
        ap.error(f"--w4a8moe: expected an executable w4a8moe program, got '{a.w4a8moe}'")
    if a.rounds < 1 or a.repeat < 1:
        ap.error(f"--rounds and --repeat: expected positive counts, got {a.rounds} and "
                 f"{a.repeat}")
    return a


def load_average():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def wait_quiet(a):
    """Waits for the quiet --max-load asks for; True if it came (or none was asked for)."""
    if a.max_load <= 0:
        return True
    deadline = time.monotonic() + a.max_wait * 60
    while True:
        busy = [p for p in a.wait_while if os.path.exists(p)]
        load = load_average()
        if not busy and load < a.max_load:
            return True
        if time.monotonic() > deadline:
            print(f"  not quiet after {a.max_wait:g} min (load {load:.2f}, {busy or 'no files'})"
                  ": measuring anyway, marked contended", file=sys.stderr)
            return False
        time.sleep(30)


def busy_seconds():
    """CPU seconds the whole machine has spent not idle (/proc/stat; steal counts as busy)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def children_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_json(cmd, what):
    """Runs cmd; returns the JSON objects of its stdout's lines, each with "others_cpu": the
    share of the machine's CPUs that other processes (or the host: steal) took meanwhile. Raises
    Failure if it fails."""
    t0, busy0, mine0 = time.monotonic(), busy_seconds(), children_seconds()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    others = busy_seconds() - busy0 - (children_seconds() - mine0)
    share = max(others, 0.0) / ((time.monotonic() - t0) * os.cpu_count())
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        raise Failure(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return [dict(json.loads(line), others_cpu=share) for line in proc.stdout.splitlines()
            if line.startswith("{")]


def w4a8moe_runs(a, group, contended):
    results = []
    for T in a.tokens:
        cmd = [a.w4a8moe, "bench", "--preset", a.preset, "--tokens", str(T), "--group",
               str(group), "--dtype", "bf16", "--scales", "f32", "--threads", str(a.threads),
               "--repeat", str(a.repeat), "--json"]
        if a.spin_us is not None:
            cmd += ["--spin-us", str(a.spin_us)]
        r = run_json(cmd, "w4a8moe bench")[-1]
        results.append(dict(r, peer="w4a8moe", regime="w4a8", contended=contended))
    return results


def zentorch_runs(a, python, regime, group, contended):
    cmd = [python, os.path.join(HERE, "zentorch_moe.py"), "--preset", a.preset, "--regime",
           regime, "--group", str(group), "--tokens", ",".join(map(str, a.tokens)), "--threads",
           str(a.threads), "--repeat", str(a.repeat), "--json"]
    return [dict(r, contended=contended) for r in run_json(cmd, "bench/zentorch_moe.py")]


def zentorch_python():
    proc = subprocess.run([os.path.join(ROOT, "scripts", "zentorch-env.sh")],
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise Failure(f"scripts/zentorch-env.sh failed (exit {proc.returncode}); see above")
    return os.path.join(proc.stdout.strip().splitlines()[-1], "bin", "python")


def configs(a):
    """(who, regime, group) in the order of a round: each zentorch run right after w4a8moe's."""
    out = []
    for g in a.groups:
        out += [("w4a8moe", "w4a8", g), ("zentorch", "da8w4", g)]
    if not a.no_da8w8:
        out.append(("zentorch", "da8w8", -1))
    return out


def measure_all(a):
    python = zentorch_python()
    results = []
    for r in range(a.rounds):
        for who, regime, group in configs(a):
            print(f"round {r + 1}/{a.rounds}: {who} {regime} group {group}", file=sys.stderr)
            quiet = wait_quiet(a)
            load = load_average()
            got = (w4a8moe_runs(a, group, not quiet) if who == "w4a8moe"
                   else zentorch_runs(a, python, regime, group, not quiet))
            for x in got:
                x.update(round=r + 1, load_at_start=load)
            if a.log:
                with open(a.log, "a") as f:
                    f.writelines(json.dumps(x) + "\n" for x in got)
            results += got
    return results


def contended(x):
    """A run that started without the quiet asked for, that shared the CPUs with other work
    (over a quarter of them), or whose MAC probe saw less than the threads' cores (w4a8moe's
    "degraded" rule, docs/performance.md)."""
    return x["contended"] or x["others_cpu"] > 0.25 or x.get("machine_degraded", False)


def read_log(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise Failure(f"--table-from: expected a --log file of JSON lines, got '{path}' ({e})")


def cell(runs):
    """median of the rounds' medians, min of the mins, and whether a run was contended."""
    return (statistics.median(x["median_ms"] for x in runs), min(x["min_ms"] for x in runs),
            any(contended(x) for x in runs))


def table(a, results):
    def runs(peer, regime, group, T):
        return [x for x in results if x["peer"] == peer and x["regime"] == regime
                and x["group"] == group and x["tokens"] == T]
    rows = ["| zentorch regime | group | tokens | w4a8moe median / min ms | zentorch median / min ms"
            " | zentorch / w4a8moe (per round) | others' CPU |", "|---|---|---|---|---|---|---|"]
    zentorch_rows = [("da8w4", g) for g in a.groups] + ([] if a.no_da8w8 else [("da8w8", -1)])
    for regime, group in zentorch_rows:
        for T in a.tokens:
            mine, theirs = runs("w4a8moe", "w4a8", group, T), runs("zentorch", regime, group, T)
            if not mine or not theirs:
                continue
            (m_med, m_min, m_c), (z_med, z_min, z_c) = cell(mine), cell(theirs)
            per_round = sorted(z["median_ms"] / m["median_ms"] for m, z in zip(mine, theirs))
            note = " (contended)" if m_c or z_c else ""
            others = max(x["others_cpu"] for x in mine + theirs)
            name = "channel" if group == -1 else str(group)
            rows.append(f"| {regime} | {name} | {T} | {m_med:.3f} / {m_min:.3f} | {z_med:.3f} / "
                        f"{z_min:.3f} | **{z_med / m_med:.2f}** "
                        f"({', '.join(f'{x:.2f}' for x in per_round)}){note} | "
                        f"up to {others:.0%} |")
    return "\n".join(rows)


def host_line(results):
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        text = f.read()
    for line in text.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    flags = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f" {f}" in text]
    sets = sorted({x.get("kernel_set", "") for x in results if x["peer"] == "w4a8moe"})
    return (f"{model}, {os.cpu_count()} CPUs, {', '.join(flags) or 'no VNNI/AMX'}; w4a8moe "
            f"kernel set {', '.join(sets)}")


def main(argv):
    a = parse_args(argv)
    try:
        results = read_log(a.table_from) if a.table_from else measure_all(a)
    except Failure as e:
        print(f"zentorch_vs_w4a8moe.py: {e}", file=sys.stderr)
        return 1
    spin = "" if a.spin_us is None else f", w4a8moe --spin-us {a.spin_us}"
    print(f"{a.preset}, {a.threads} threads, bf16 x, f32 scales, cold weights, {a.rounds} "
          f"rounds of {a.repeat} calls{spin}; {host_line(results)}\n")
    print(table(a, results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
