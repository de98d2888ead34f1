"""vLLM, end to end on the CPU, as a user runs it: a synthetic model of a real MoE model's shapes
at any depth, up to the whole model with its real vocabulary (bench/vllm_engine_models.py writes
it one layer at a time), run by vllm.LLM in bfloat16 in vLLM's default compiled mode (--eager
for enforce_eager), in each format a user downloads, through w4a8moe's plugin, through vLLM's own
quantized path (the plugin told to leave the family to vLLM with W4A8MOE_VLLM_FORMATS; on a CPU
without AMX vLLM refuses these) and in bfloat16; and llama.cpp on GGUFs of the same shapes, depth
and vocabulary (bench/llama_cpp.py), in the same run:

  --shape qwen3-30b-a3b  rows gptq (GPTQ int4 g128, experts and attention, as GPTQModel and
                         AutoRound ship it; the attention on vLLM's own int4 kernel where it has
                         one), gptq-dense (the attention through w4a8moe: W4A8MOE_VLLM_DENSE=on),
                         gptq-int8 (the LM head in int8: W4A8MOE_VLLM_QUANTIZE_DENSE=int8),
                         gptq-dense-int8 (both), w4a8
                         (compressed-tensors W4A8), w4a16, bf16, and the "-vllm" rows of the same
                         files on vLLM's own path; llama.cpp (Q4_0)
  --shape gpt-oss-20b    rows mxfp4 (OpenAI's layout, bfloat16 attention), mxfp4-int8 (attention
                         and LM head in int8), bf16, mxfp4-vllm; llama.cpp (MXFP4 experts, Q8_0
                         attention)
  --shape deepseek-v2-lite  rows w4a16 (compressed-tensors W4A16 routed experts; latent
                         attention and shared experts bfloat16), w4a16-vllm, bf16 (vLLM's bf16
                         path); no llama.cpp row (no GGUF writer of this shape)

Per row: load_s (vllm.LLM() from the call to a ready engine: weights read and packed, the graph
compiled and warmed up) and its parts weights_s (the model runner's load: the checkpoint read and
each layer packed), read_s, compile_s and engine_init_s (from vLLM's log); peak_rss_gb (the
engine process's peak resident memory, VmHWM), weights_rss_gb and load_rss_gb (the same when the
weights were loaded, when the engine was ready), after_weights_rss_gb (the resident memory, VmRSS,
when the weights were loaded) and model_tensors_gb (the bytes of the model's parameters and
buffers then), peak_anon_gb and peak_file_gb (the peaks of its two parts: tensors
and heap; mapped files such as checkpoint shards), checkpoint_gb; prefill_s and prefill_2048_s
(one prompt of 512 / 2048 tokens, max_tokens 1, seconds); decode_b{1,8,32}_tok_s (--decode tokens
after a 16-token prompt at batch B, less the same prompt with max_tokens 1, aggregate tokens/s).
Each figure is the median of --repeat runs after one warm-up; each row runs in its own process
(an engine to itself) with W4A8MOE_VLLM_TRACE set, so the table says which path ran. A row whose
checkpoint cannot fit the machine's memory is skipped with the reason (the W4A8 int8 storage and
bfloat16 rows of the whole models).

    V=$(scripts/vllm-env.sh)
    $V/bin/python bench/vllm_engine.py --shape qwen3-30b-a3b --layers 48 --vocab 151936 --only gptq,llama.cpp
    $V/bin/python bench/vllm_engine.py --shape gpt-oss-20b --layers 24 --vocab 201088 --only mxfp4,llama.cpp
    $V/bin/python bench/vllm_engine.py --shape deepseek-v2-lite --layers 4 --vocab 102400

Prints a Markdown table; --json adds one JSON line per row. --load-only stops each engine once
it is ready (the load's columns: the before and after of a change to loading or packing).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vllm_engine_models as models  # noqa: E402

OURS = {}
THEIRS = {"W4A8MOE_VLLM_FORMATS": "w4a8,mxfp4"}  # int4 WNA16 left to vLLM
# (row id, weights, folder kind, environment, whose path)
INT8 = {"W4A8MOE_VLLM_QUANTIZE_DENSE": "int8"}  # bfloat16 dense layers and LM head in int8
_QWEN3 = [("gptq", "GPTQ int4 g{g}, attention int4", "gptq", OURS, "w4a8moe"),
          ("gptq-dense", "GPTQ int4 g{g}, attention int4", "gptq",
           {"W4A8MOE_VLLM_DENSE": "on"}, "w4a8moe"),
          ("gptq-int8", "GPTQ int4 g{g}, attention int4, LM head int8", "gptq", INT8,
           "w4a8moe"),
          ("gptq-dense-int8", "GPTQ int4 g{g}, attention int4, LM head int8", "gptq",
           {**INT8, "W4A8MOE_VLLM_DENSE": "on"}, "w4a8moe"),
          ("gptq-vllm", "GPTQ int4 g{g}, attention int4", "gptq", THEIRS, "vLLM's own"),
          ("w4a8", "W4A8 int4 g{g}", "w4a8", OURS, "w4a8moe"),
          ("w4a16", "W4A16 int4 g{g}", "w4a16", OURS, "w4a8moe"),
          ("w4a16-vllm", "W4A16 int4 g{g}", "w4a16", THEIRS, "vLLM's own"),
          ("bf16", "bfloat16", "bf16", OURS, "vLLM's own")]
_GPT_OSS = [("mxfp4", "MXFP4, attention bf16", "mxfp4", OURS, "w4a8moe"),
            ("mxfp4-int8", "MXFP4, attention and LM head int8", "mxfp4", INT8, "w4a8moe"),
            ("mxfp4-vllm", "MXFP4, attention bf16", "mxfp4",
             {"W4A8MOE_VLLM_FORMATS": "w4a8,wna16"}, "vLLM's own"),
            ("bf16", "bfloat16", "bf16", OURS, "vLLM's own")]
_DEEPSEEK_V2_LITE = [("w4a16", "W4A16 int4 g{g}", "w4a16", OURS, "w4a8moe"),
                     ("w4a16-vllm", "W4A16 int4 g{g}", "w4a16", THEIRS, "vLLM's own"),
                     ("bf16", "bfloat16", "bf16", OURS, "vLLM's own")]
CONFIGS = {"qwen3-30b-a3b": _QWEN3, "gpt-oss-20b": _GPT_OSS,
           "deepseek-v2-lite": _DEEPSEEK_V2_LITE}
PEER = "llama.cpp"
PEER_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")  # the shapes bench/llama_cpp.py writes
BATCHES = (1, 8, 32)
# parts of load_s from vLLM's log: the checkpoint read, torch.compile, and the engine's set-up
# after the model (profile run, KV cache, warm-up); weights_s (read and packed) is timed below
LOAD_PARTS = {"read_s": r"Loading weights took ([\d.]+) seconds",
              "compile_s": r"torch.compile took ([\d.]+) s in total",
              "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took "
                               r"([\d.]+)"}
COLUMNS = [("load_s", "load (s)", "{:.0f}"), ("peak_rss_gb", "peak RSS (GB)", "{:.1f}"),
           ("prefill_s", "prefill 512 (s)", "{:.3f}"), ("prefill_2048_s", "prefill 2048 (s)",
                                                         "{:.3f}")] + [
    (f"decode_b{b}_tok_s", f"decode b{b} (tok/s)", "{:.1f}") for b in BATCHES]


def _rss_gb(field):
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


class _RssParts:
    """The peaks of the process's anonymous memory (tensors, heap) and of its file pages
    (mapped checkpoint shards, libraries), which VmHWM sums, polled every 20 ms on a thread."""

    def __init__(self):
        import threading

        self.peak = {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.wait(0.02):
            for field in self.peak:
                self.peak[field] = max(self.peak[field], _rss_gb(field))

    def stop(self):
        self._stop.set()
        self._thread.join()
        return {"peak_anon_gb": self.peak["RssAnon"], "peak_file_gb": self.peak["RssFile"]}


def run_one(path, args):
    """In this process: the engine on `path`; prints a JSON line of medians."""
    from vllm import LLM, SamplingParams

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    prefills = (512, 2048)
    result = {}
    load_model = CPUModelRunner.load_model

    def timed_load(self, *a, **kw):  # the checkpoint read, then each layer's packing
        begin = time.perf_counter()
        load_model(self, *a, **kw)
        result["weights_s"] = time.perf_counter() - begin
        result["weights_rss_gb"] = _rss_gb("VmHWM")
        result["after_weights_rss_gb"] = _rss_gb("VmRSS")
        model = self.model  # what the model's tensors hold, beside what the process holds
        tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        result["model_tensors_gb"] = sum(t.numel() * t.element_size()
                                         for t in tensors.values()) / 1e9

    CPUModelRunner.load_model = timed_load  # the engine runs in this process
    parts = _RssParts()
    start = time.perf_counter()
    # no prefix caching: the timed runs repeat their prompts, whose KV a cache would keep
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=args.eager, skip_tokenizer_init=True,
              max_model_len=max(prefills) + args.decode + 32, max_num_seqs=max(BATCHES),
              max_num_batched_tokens=max(prefills), seed=0, enable_prefix_caching=False)
    result.update(load_s=time.perf_counter() - start, load_rss_gb=_rss_gb("VmHWM"))
    import torch

    result["threads"] = torch.get_num_threads()

    if args.load_only:
        result["peak_rss_gb"] = _rss_gb("VmHWM")
        result.update(parts.stop())
        print(json.dumps(result))
        return

    def timed(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        begin = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - begin

    def median(prompts, tokens):
        timed(prompts, tokens)  # warm-up
        return statistics.median(timed(prompts, tokens) for _ in range(args.repeat))

    for n in prefills:
        key = "prefill_s" if n == 512 else f"prefill_{n}_s"
        result[key] = median([[(7 * i + n) % args.vocab for i in range(n)]], 1)
    for batch in BATCHES:
        prompts = [[(13 * i + b) % args.vocab for i in range(16)] for b in range(batch)]
        delta = median(prompts, args.decode + 1) - median(prompts, 1)
        result[f"decode_b{batch}_tok_s"] = batch * args.decode / delta
    result["peak_rss_gb"] = _rss_gb("VmHWM")
    result.update(parts.stop())
    print(json.dumps(result))


def _vllm_row(args, path, env_extra):
    """One engine in its own process; returns (result dict, packed layers, linear layers)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", W4A8MOE_VLLM_TRACE=trace,
                   **env_extra)
        # GiB (10k tokens of Qwen3-30B-A3B: every request here fits); else vLLM asks for 92% of
        # a node, and a whole model of 17 GB has to fit beside it in 24
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # the model's threads: vLLM otherwise cuts an in-process engine to 1 (and its server on a
        # 2-CPU host binds the model to 1 core, keeping the other for its scheduler process)
        env["OMP_NUM_THREADS"] = str(args.threads)
        proc = subprocess.run([sys.executable, __file__, "--run-one", path] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "decode", "repeat")] + (
            ["--eager"] if args.eager else []) + (["--load-only"] if args.load_only else []),
            capture_output=True, text=True, env=env)
        packed = linear = int8 = 0
        if os.path.exists(trace):
            with open(trace, encoding="utf-8") as f:
                words = [line.split()[1:2] for line in f]
            packed, linear, int8 = (words.count([w]) for w in ("pack", "linear", "int8"))
    last = (proc.stdout.strip().splitlines() or ["{}"])[-1]
    try:
        r = json.loads(last)
    except json.JSONDecodeError:
        r = {}
    if proc.returncode != 0 or not r:
        err = [line for line in proc.stderr.strip().splitlines() if "Error" in line]
        r = {"error": (err or proc.stderr.strip().splitlines() or ["?"])[-1][:240]}
    log = proc.stdout + proc.stderr  # vLLM logs to stdout
    for key, pattern in LOAD_PARTS.items():
        found = re.search(pattern, log)
        if found:
            r[key] = float(found.group(1))
    if args.keep_logs:
        with open(os.path.join(args.root, f"log-{os.path.basename(path)}.txt"), "w",
                  encoding="utf-8") as f:
            f.write(log)
    return r, packed, linear, int8


def _peer_row(args):
    """llama.cpp's row, from bench/llama_cpp.py in its own environment."""
    cmd = [sys.executable, os.path.join(HERE, "llama_cpp.py"), "--shape", args.shape,
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--threads",
           str(args.threads), "--decode", str(args.decode), "--repeat", str(args.repeat),
           "--batches", ",".join(map(str, BATCHES)), "--root", args.root, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:240]
        return {"error": f"{' '.join(cmd[1:3])} failed: {tail}"}
    return json.loads(lines[-1])


def _memory_gb():
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("inf")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=models.SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="threads of the model, vLLM's (OMP_NUM_THREADS) and llama.cpp's "
                             "(-t) alike (default: every CPU)")
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager (no torch.compile); the default is vLLM's default")
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "w4a8moe-vllm-bench"))
    parser.add_argument("--only", help="comma list of row ids (default: all of the shape's: "
                        + "; ".join(f"{k}: " + ",".join([c[0] for c in v] + (
                                        [PEER] if k in PEER_SHAPES else []))
                                    for k, v in CONFIGS.items()) + ")")
    parser.add_argument("--keep-logs", action="store_true",
                        help="write each engine's log to ROOT/log-<folder>.txt")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--load-only", action="store_true",
                        help="stop when the engine is ready: the load's columns only (no llama.cpp "
                             "row)")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        return run_one(args.run_one, args)
    if args.layers < 1 or args.vocab < 32:
        parser.error(f"--layers: expected >= 1, --vocab: >= 32; got {args.layers}, {args.vocab}")
    if args.shape == "deepseek-v2-lite" and args.layers < 2:
        parser.error(f"--layers: expected >= 2 for deepseek-v2-lite (its first layer is dense), "
                     f"got {args.layers}")
    configs = CONFIGS[args.shape]
    ids = [c[0] for c in configs] + ([PEER] if args.shape in PEER_SHAPES else [])
    wanted = args.only.split(",") if args.only else ids
    unknown = [w for w in wanted if w not in ids]
    if unknown:
        parser.error(f"--only: {unknown} are not rows of {args.shape} ({','.join(ids)})")
    configs = [c for c in configs if c[0] in wanted]
    os.makedirs(args.root, exist_ok=True)
    # a row's checkpoint must fit in memory beside 4 GB for the engine (KV cache, activations)
    room = _memory_gb() - 4
    sizes = {c[2]: models.estimate_gb(args.shape, c[2], args.layers, args.vocab, args.group)
             for c in configs}
    kinds = sorted({k for k, gb in sizes.items() if gb <= room})
    if args.shape == "qwen3-30b-a3b":
        paths = models.qwen3(args.root, args.layers, args.vocab, args.group, kinds)
    elif args.shape == "deepseek-v2-lite":
        paths = models.deepseek_v2_lite(args.root, args.layers, args.vocab, args.group, kinds)
    else:
        paths = models.gpt_oss(args.root, args.layers, args.vocab, kinds)
    rows = []
    for row_id, weights, kind, extra, whose in configs:
        if kind not in paths:
            r = {"error": f"skipped: a {sizes[kind]:.0f} GB checkpoint does not fit in "
                          f"{room + 4:.0f} GB of memory with the engine"}
            path = whose
        else:
            r, packed, linear, int8 = _vllm_row(args, paths[kind], extra)
            r["checkpoint_gb"] = models.folder_gb(paths[kind])
            path = f"w4a8moe ({packed} MoE layers packed)" if packed else whose
            if linear:
                path += f", {linear} int4 dense layers by w4a8moe"
            if int8:
                path += f", {int8} dense layers int8 by w4a8moe"
            if whose == "w4a8moe" and not packed:
                path += " (w4a8moe did not run: see the log)"
        rows.append((row_id, weights.format(g=args.group), path, r))
        if args.json:
            print(json.dumps({"config": row_id, "path": path, **r}), flush=True)
    if PEER in wanted and not args.load_only:
        r = _peer_row(args)
        rows.append((PEER, r.pop("weights", "GGUF"), r.pop("path", PEER), r))
        if args.json:
            print(json.dumps({"config": PEER, **r}), flush=True)
    print(f"\n{args.shape}: {args.layers} layers, vocabulary {args.vocab}, {os.cpu_count()} "
          f"CPUs, vLLM {'eager' if args.eager else 'compiled'}; medians of {args.repeat}\n")
    print("| weights | path | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for _, weights, path, r in rows:
        if "error" in r:
            print(f"| {weights} | {path} | {r['error']} |" + " |" * (len(COLUMNS) - 1))
        else:
            cells = [fmt.format(r[key]) if isinstance(r.get(key), (int, float)) else ""
                     for key, _, fmt in COLUMNS]
            print(f"| {weights} | {path} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
