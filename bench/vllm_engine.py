"""vLLM, end to end on the CPU: a synthetic model of a real MoE model's shapes and a few layers
(bench/vllm_engine_models.py), run by vllm.LLM in bfloat16 on the same weights in each format a
user downloads, through w4a8moe's plugin, through vLLM's own quantized path (the plugin told to
leave the family to vLLM with W4A8MOE_VLLM_FORMATS; on a CPU without AMX vLLM refuses these),
and dequantized in bfloat16 (vLLM's bf16 MoE path):

  --shape qwen3-30b-a3b  W4A8, GPTQ and W4A16 int4, group --group (default 128)
  --shape gpt-oss-20b    MXFP4

Prefill: one prompt of --prefill tokens, max_tokens 1 (seconds). Decode: --decode tokens after
a 16-token prompt at batch 1 and 8, less the same prompt with max_tokens 1, as tokens/s. Each
figure is the median of --repeat runs after one warm-up; each configuration runs in its own
process (an engine to itself), with W4A8MOE_VLLM_TRACE set, so the table says which path ran
(the layers w4a8moe packed). The vocabulary is small (--vocab) so the MoE layers, not the LM
head, are the cost. All runs use enforce_eager (no torch.compile), the same for every row.

    V=$(scripts/vllm-env.sh); $V/bin/python bench/vllm_engine.py --shape qwen3-30b-a3b --layers 4
    V=$(scripts/vllm-env.sh); $V/bin/python bench/vllm_engine.py --shape gpt-oss-20b --layers 2

Prints a Markdown table; --json adds one JSON line per configuration.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_engine_models  # noqa: E402

# (row id, weights, folder kind, environment, whose path); "theirs": the family left to vLLM
_QWEN3 = [("w4a8", "W4A8 int4 g{g}", "w4a8", {}, "w4a8moe"),
          ("gptq", "GPTQ int4 g{g}", "gptq", {}, "w4a8moe"),
          ("gptq-vllm", "GPTQ int4 g{g}", "gptq", {"W4A8MOE_VLLM_FORMATS": "w4a8,mxfp4"},
           "vLLM's own"),
          ("w4a16", "W4A16 int4 g{g}", "w4a16", {}, "w4a8moe"),
          ("w4a16-vllm", "W4A16 int4 g{g}", "w4a16", {"W4A8MOE_VLLM_FORMATS": "w4a8,mxfp4"},
           "vLLM's own"),
          ("bf16", "bfloat16", "bf16", {}, "vLLM's own")]
_GPT_OSS = [("mxfp4", "MXFP4", "mxfp4", {}, "w4a8moe"),
            ("mxfp4-vllm", "MXFP4", "mxfp4", {"W4A8MOE_VLLM_FORMATS": "w4a8,wna16"},
             "vLLM's own"),
            ("bf16", "bfloat16", "bf16", {}, "vLLM's own")]
CONFIGS = {"qwen3-30b-a3b": _QWEN3, "gpt-oss-20b": _GPT_OSS}


def run_one(path, args):
    """In this process: the engine on `path`; prints a JSON line of medians."""
    from vllm import LLM, SamplingParams

    # no prefix caching: the timed runs repeat their prompts, whose KV a cache would keep
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=args.prefill + args.decode + 32, max_num_seqs=8,
              max_num_batched_tokens=max(args.prefill, 1024), seed=0,
              enable_prefix_caching=False)

    def timed(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    def median(prompts, tokens):
        timed(prompts, tokens)  # warm-up
        return statistics.median(timed(prompts, tokens) for _ in range(args.repeat))

    result = {"prefill_s": median([[(7 * i) % args.vocab for i in range(args.prefill)]], 1)}
    for batch in (1, 8):
        prompts = [[(13 * i + b) % args.vocab for i in range(16)] for b in range(batch)]
        delta = median(prompts, args.decode + 1) - median(prompts, 1)
        result[f"decode_b{batch}_tok_s"] = batch * args.decode / delta
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=vllm_engine_models.SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "w4a8moe-vllm-bench"))
    parser.add_argument("--only", help="comma list of row ids (default: all of the shape's: "
                        + "; ".join(f"{k}: " + ",".join(c[0] for c in v)
                                    for k, v in CONFIGS.items()) + ")")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        return run_one(args.run_one, args)
    configs = CONFIGS[args.shape]
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in [c[0] for c in configs]]
        if unknown:
            parser.error(f"--only: {unknown} are not rows of {args.shape} "
                         f"({','.join(c[0] for c in configs)})")
        configs = [c for c in configs if c[0] in wanted]
    if args.shape == "qwen3-30b-a3b":
        paths = vllm_engine_models.qwen3(args.root, args.layers, args.vocab, args.group)
    else:
        paths = vllm_engine_models.gpt_oss(args.root, args.layers, args.vocab)
    rows = []
    for row_id, weights, kind, extra, whose in configs:
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace")
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", W4A8MOE_VLLM_TRACE=trace,
                       **extra)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; else vLLM asks for 92% of a node
            proc = subprocess.run([sys.executable, __file__, "--run-one", paths[kind]] + [
                f"--{k}={getattr(args, k)}" for k in ("vocab", "prefill", "decode", "repeat")],
                capture_output=True, text=True, env=env)
            packed = 0
            if os.path.exists(trace):
                with open(trace, encoding="utf-8") as f:
                    packed = sum(1 for line in f if line.split()[1:2] == ["pack"])
        last = (proc.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            r = json.loads(last)
        except json.JSONDecodeError:
            r = {}
        if proc.returncode != 0 or not r:
            err = [line for line in proc.stderr.strip().splitlines() if "Error" in line]
            r = {"error": (err or proc.stderr.strip().splitlines() or ["?"])[-1][:240]}
        path = f"w4a8moe ({packed} layers packed)" if packed else whose
        if whose == "w4a8moe" and not packed:
            path += " (w4a8moe did not run: see the log)"
        rows.append((weights.format(g=args.group), path, r))
        if args.json:
            print(json.dumps({"config": row_id, "path": path, **r}), flush=True)
    print(f"\n{args.shape}: {args.layers} layers, vocabulary {args.vocab}, {os.cpu_count()} "
          f"CPUs; medians of {args.repeat}\n")
    print(f"| weights | path | prefill {args.prefill} (s) | decode b1 (tok/s) | "
          "decode b8 (tok/s) |")
    print("|---|---|---|---|---|")
    for weights, path, r in rows:
        if "error" in r:
            print(f"| {weights} | {path} | {r['error']} | | |")
        else:
            print(f"| {weights} | {path} | {r['prefill_s']:.3f} | {r['decode_b1_tok_s']:.2f} | "
                  f"{r['decode_b8_tok_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
