"""llama.cpp, end to end on the CPU, as a peer row of bench/vllm_engine.py: the same model shapes
and depth (bench/llama_cpp_models.py writes them as GGUF files: Q4_0 for qwen3-30b-a3b, MXFP4
experts and Q8_0 attention for gpt-oss-20b), run by llama.cpp's own benchmarks, built by
scripts/llama-cpp-env.sh (llama.cpp 0c1e57098bba, its default CPU build: GGML_NATIVE, OpenMP,
CPU_REPACK).

  prefill_s, prefill_<P>_s  seconds of one prompt of P tokens (the first of --prefill is
                            prefill_s): llama-bench -p P -n 0, median of --repeat
  decode_b1_tok_s           tokens/s at batch 1: llama-bench -p 0 -n --decode, median
  decode_b<B>_tok_s         aggregate tokens/s of B sequences (B > 1 of --batches), each with
                            its own 16-token prompt, as in bench/vllm_engine.py:
                            llama-batched-bench -npp 16 -ntg --decode -npl B, median of
                            --repeat runs in one process
  load_s                    llama.cpp's own load time (reading the model, repacking its
                            weights and the first evaluation: llama-batched-bench's
                            "load time"), as llama-bench does not report one
  peak_rss_gb               the peak resident set of the llama-bench process, GB (its mapped
                            model pages and repacked weights included)

One llama-bench process runs the prefill and batch-1 tests (-p P1,P2 -n N: the same tests as
separate -n 0 and -p 0 runs, with one model load); each test is run once unmeasured first. Flash
attention, batch and micro-batch sizes are llama.cpp's defaults in both programs. Its OpenMP
workers spin while they wait, so any other load on the CPUs collapses its figures (batch-1
decode came out 10 to 90 times slower beside a compile on 2 vCPUs): run it on an idle machine.

It runs in the venv of scripts/llama-cpp-env.sh --python (gguf-py and numpy write the models):
started by any other Python it re-executes itself there, so a plain `python3` works:

    python3 bench/llama_cpp.py --shape qwen3-30b-a3b --layers 2 --vocab 4096 --threads 2 --json
    python3 bench/llama_cpp.py --shape gpt-oss-20b --layers 24 --vocab 201088 --json

Prints one human-readable line, then with --json one JSON line (the last line) with the keys
config ("llama.cpp"), path, the figures above; on a failure that JSON line holds "error" and the
exit status is 1. The GGUF files are cached under --root by (shape, layers, vocab).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ENV_SCRIPT = os.path.normpath(os.path.join(HERE, "..", "scripts", "llama-cpp-env.sh"))
PROMPT_TOKENS = 16  # each decoding sequence's prompt, as bench/vllm_engine.py's
WEIGHTS = {"qwen3-30b-a3b": "Q4_0, Q6_K output", "gpt-oss-20b": "MXFP4 experts, Q8_0 attention"}


class Failure(Exception):
    """A step that failed, with a sentence saying which and why."""


def _tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def _env_script(*args):
    """scripts/llama-cpp-env.sh's one line of output (its progress goes to our stderr)."""
    cmd = [ENV_SCRIPT, *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise Failure(f"{' '.join(cmd)} failed (exit {proc.returncode}); its messages are above")
    return proc.stdout.strip().splitlines()[-1]


def _reexec_in_venv():
    """Re-executes this script in the llama.cpp venv unless it already runs there."""
    python = _env_script("--python")
    venv = os.path.dirname(os.path.dirname(python))
    if os.path.realpath(sys.prefix) != os.path.realpath(venv):
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])


def _run(cmd):
    """Runs `cmd`; returns (stdout, stderr, peak RSS in bytes of that process alone). Raises
    Failure with the command and its stderr's tail if it fails."""
    if not os.access(cmd[0], os.X_OK):
        raise Failure(f"{cmd[0]} is missing or not executable (scripts/llama-cpp-env.sh builds it)")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        # wait4, not wait: the rusage of this child alone (RUSAGE_CHILDREN is the largest of all)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise Failure(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{_tail(stderr)}")
    return stdout, stderr, usage.ru_maxrss * 1024


def _llama_bench(bins, model, args):
    """llama-bench's prefill and batch-1 decode tests: ({P: seconds}, tokens/s, peak RSS)."""
    # -v: llama.cpp's messages on stderr, which say why a model did not load
    cmd = [os.path.join(bins, "llama-bench"), "-m", model, "-t", str(args.threads),
           "-p", ",".join(map(str, args.prefill)), "-n", str(args.decode), "-r", str(args.repeat),
           "-o", "json", "-v"]
    stdout, stderr, rss = _run(cmd)
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise Failure(f"{' '.join(cmd)} printed no JSON ({e}):\n{_tail(stdout + stderr)}") from e
    prefill, decode = {}, None
    for t in tests:
        seconds = statistics.median(t["samples_ns"]) / 1e9
        if t["n_prompt"] > 0 and t["n_gen"] == 0:
            prefill[t["n_prompt"]] = seconds
        elif t["n_gen"] > 0 and t["n_prompt"] == 0:
            decode = t["n_gen"] / seconds
    missing = [p for p in args.prefill if p not in prefill] + (["decode"] if decode is None else [])
    if missing:
        raise Failure(f"{' '.join(cmd)} reported no test for {missing}:\n{_tail(stdout)}")
    return prefill, decode, rss, tests[0]


def _batched_bench(bins, model, args, batches):
    """llama-batched-bench's aggregate decode tokens/s per batch, and llama.cpp's load time."""
    # llama.cpp gives each sequence its own KV cells, a multiple of 256
    per_seq = -(-(PROMPT_TOKENS + args.decode) // 256) * 256
    # -lv 4: llama.cpp's info messages, among them the load time
    cmd = [os.path.join(bins, "llama-batched-bench"), "-m", model, "-t", str(args.threads),
           "-tb", str(args.threads), "-c", str(max(batches) * per_seq), "-lv", "4",
           "-npp", str(PROMPT_TOKENS), "-ntg", str(args.decode),
           "-npl", ",".join(str(b) for _ in range(args.repeat) for b in batches),
           "--output-format", "jsonl"]
    stdout, stderr, _ = _run(cmd)
    speeds = {}
    for line in (stdout + "\n" + stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            speeds.setdefault(r["pl"], []).append(r["speed_tg"])
    missing = [b for b in batches if b not in speeds]
    if missing:
        raise Failure(f"{' '.join(cmd)} reported no result for batches {missing} (too small a "
                      f"context?):\n{_tail(stdout + stderr)}")
    load = re.findall(r"load time\s*=\s*([0-9.]+) ms", stdout + stderr)
    if not load:
        raise Failure(f"{' '.join(cmd)} printed no load time:\n{_tail(stdout + stderr)}")
    return {b: statistics.median(v) for b, v in speeds.items()}, float(load[-1]) / 1e3


def measure(args):
    """Builds (once) llama.cpp and the model, runs both programs; returns the result dict."""
    import llama_cpp_models

    bins = _env_script()
    model = llama_cpp_models.write(args.shape, args.root, args.layers, args.vocab)
    prefill, decode_b1, rss, info = _llama_bench(bins, model, args)
    result = {"config": "llama.cpp",
              "path": f"llama.cpp {info.get('build_commit', '?')}, ggml CPU"
                      f"{' with repack' if info.get('repack') else ''}: {WEIGHTS[args.shape]}"}
    for i, p in enumerate(args.prefill):
        result["prefill_s" if i == 0 else f"prefill_{p}_s"] = prefill[p]
    if 1 in args.batches:
        result["decode_b1_tok_s"] = decode_b1
    larger = [b for b in args.batches if b > 1]
    if larger:
        speeds, load = _batched_bench(bins, model, args, larger)
        for b in larger:
            result[f"decode_b{b}_tok_s"] = speeds[b]
    else:
        _, load = _batched_bench(bins, model, args, [1])
    result["load_s"] = load
    result["peak_rss_gb"] = rss / 1e9
    return result


def _ints(text):
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("qwen3-30b-a3b", "gpt-oss-20b"),
                        default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prefill", type=_ints, default=[512, 2048],
                        help="prompt lengths (default 512,2048; the first is prefill_s)")
    parser.add_argument("--decode", type=int, default=32, help="tokens generated (default 32)")
    parser.add_argument("--batches", type=_ints, default=[1, 8, 32],
                        help="decode batches (default 1,8,32)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "w4a8moe-llama-cpp-bench"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        _reexec_in_venv()
        sys.path.insert(0, HERE)
        r = measure(args)
    except (Failure, OSError, RuntimeError, ValueError) as e:
        print(f"llama_cpp.py: {e}", file=sys.stderr)
        if args.json:  # the failed step and its last message, for a table cell
            lines = str(e).strip().splitlines() or ["?"]
            brief = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "")
            print(json.dumps({"config": "llama.cpp", "error": brief[:300]}))
        return 1
    prefill = ", ".join(f"{p}: {r['prefill_s' if i == 0 else f'prefill_{p}_s']:.3f} s"
                        for i, p in enumerate(args.prefill))
    decode = ", ".join(f"b{b}: {r[f'decode_b{b}_tok_s']:.1f}" for b in args.batches)
    print(f"llama.cpp {args.shape}, {args.layers} layers, vocabulary {args.vocab}, "
          f"{args.threads} threads, medians of {args.repeat}: prefill {prefill}; decode tok/s "
          f"{decode}; load {r['load_s']:.2f} s; peak RSS {r['peak_rss_gb']:.2f} GB "
          f"[{r['path']}]", flush=True)
    if args.json:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
