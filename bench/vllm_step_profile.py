"""Where a decode step of vLLM goes: one of bench/vllm_engine.py's checkpoints in vllm.LLM (vLLM's
default compiled mode; --eager for enforce_eager), --decode tokens at batch B under PyTorch's
profiler, the ops' CPU time per step sorted into the parts of a step:

  MoE        w4a8moe's MoE op (or vLLM's own experts)
  LM head    everything under vLLM's LogitsProcessor._get_logits (the vocabulary's GEMM)
  sampler    everything under vLLM's Sampler.forward
  dense      every other dense GEMM: attention projections (q/k/v/o), shared experts, router
  attention  vLLM's CPU attention kernels (KV cache write, paged attention)
  compiled kernels  in compiled mode, the kernels torch.compile generated around those ops
             (norms, rope, the router's softmax and top-k, residual adds): the profiler sees
             them only as the compiled graph's own time
  other ops  every other op (in eager mode the norms, rope, routing; copies, the inputs' ops)
  not in ops the step's wall time less its ops: vLLM's scheduler, Python, the inputs' preparation

The LM head and the sampler run outside the compiled graph; this script wraps the two vLLM
methods in profiler scopes (here only, for the measurement) to tell their ops apart.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the profiler sees the
model's ops; times are per decoded step (a step decodes one token of every sequence). Each op's
time is its own CPU time on the calling thread, which for the multi-threaded kernels is its wall
time (the caller waits for its workers).

    V=$(scripts/vllm-env.sh)
    $V/bin/python bench/vllm_step_profile.py /tmp/w4a8moe-vllm-bench/gptq-qwen3-L48-V151936-g128 --batch 1,8

Prints a Markdown table per batch; --json one JSON line per batch; --top N lists the N costliest
ops too.
"""

import argparse
import json
import os
import sys
import time

SCOPES = {"bench::lm_head": "LM head", "bench::sampler": "sampler"}
# (part, substrings of the profiler's op name), first match wins, for ops outside SCOPES
PARTS = [
    ("MoE", ("w4a8moe::moe_routed", "w4a8moe::dynamic_4bit_int_moe", "w4a8moe::forward_local",
             "fused_moe",
             "cpu_fused_moe", "experts")),
    ("dense", ("w4a8moe::linear", "onednn_mm", "cpu_gemm_wna16", "weight_packed_linear",
               "aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "zentorch_linear")),
    ("attention", ("cpu_attn", "paged_attention", "attention", "reshape_and_cache")),
    ("compiled kernels", ("CompiledFxGraph", "CompiledFunction", "Torch-Compiled Region")),
]


def _part(event):
    """The part an event's own time belongs to: its scope's, else its name's."""
    parent = event
    while parent is not None:
        if parent.name in SCOPES:
            return SCOPES[parent.name]
        parent = parent.cpu_parent
    for part, keys in PARTS:
        if any(k in event.name for k in keys):
            return part
    return "other ops"


def _scoped(cls, method, name):
    """Wraps cls.method in a profiler scope called name."""
    import torch

    inner = getattr(cls, method)

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return inner(*args, **kwargs)

    setattr(cls, method, wrapped)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint folder of bench/vllm_engine.py")
    parser.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    parser.add_argument("--decode", type=int, default=16, help="tokens per sequence profiled")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    _scoped(LogitsProcessor, "_get_logits", "bench::lm_head")
    _scoped(Sampler, "forward", "bench::sampler")
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=args.eager,
              skip_tokenizer_init=True, max_model_len=512, max_num_seqs=max(batches),
              seed=0, enable_prefix_caching=False)

    def run(batch, tokens):
        prompts = [{"prompt_token_ids": [(13 * i + b) % vocab for i in range(16)]}
                   for b in range(batch)]
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        begin = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - begin

    for batch in batches:
        run(batch, args.decode + 1)  # warm-up (graphs for this batch size)
        # the prompt's step alone, to take it out of the profiled run's ops and wall time
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prefill:
            wall_prefill = run(batch, 1)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            wall = run(batch, args.decode + 1)
        steps = args.decode
        parts = {p: 0.0 for p in ("MoE", "LM head", "sampler", "dense", "attention",
                                  "compiled kernels", "other ops")}
        ops = {}
        for sign, p in ((1, prof), (-1, prefill)):
            for e in p.events():
                ms = sign * e.self_cpu_time_total / 1000
                parts[_part(e)] += ms
                shapes = [s for s in (e.input_shapes or []) if s]
                key = (e.name, str(shapes[:2]))
                ops[key] = ops.get(key, 0.0) + ms
        per_step = {p: ms / steps for p, ms in parts.items()}
        wall_ms = (wall - wall_prefill) * 1000 / steps
        per_step["not in ops"] = wall_ms - sum(per_step.values())
        row = {"batch": batch, "step_ms": wall_ms, **{f"{p}_ms": v for p, v in per_step.items()}}
        if args.json:
            print(json.dumps(row), flush=True)
        print(f"\nbatch {batch}: {wall_ms:.2f} ms a step ({batch * 1000 / wall_ms:.1f} tokens/s), "
              f"{args.decode} steps, {'eager' if args.eager else 'compiled'}, "
              f"{torch.get_num_threads()} threads\n")
        print("| part | ms a step | share |\n|---|---|---|")
        for p, v in per_step.items():
            print(f"| {p} | {v:.2f} | {100 * v / wall_ms:.0f}% |")
        if args.top:
            print(f"\n| op | input shapes | ms a step |\n|---|---|---|")
            for (name, shapes), ms in sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"| {name} | {shapes} | {ms / steps:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
