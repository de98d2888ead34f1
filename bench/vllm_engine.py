"""vLLM, end to end on the CPU: a synthetic model with Qwen3-30B-A3B's MoE shapes (H 2048, MoE I
768, 128 experts, top-8; attention 32 heads, 4 KV heads, head dim 128) and a few layers, run by
vllm.LLM in bfloat16 three ways on the same int4 weights:

  w4a8moe   compressed-tensors W4A8 (int-quantized, int4 symmetric, group G, dynamic int8
            activations): vLLM's W4A8 MoE method, its experts run by w4a8moe's plugin
  vllm-int4 GPTQ (4 bits, group G, sym, desc_act false): vLLM's own CPU int4 MoE path
  bf16      the dequantized weights in bfloat16: vLLM's bf16 MoE path

Prefill: one prompt of --prefill tokens, max_tokens 1 (seconds). Decode: --decode tokens after
a 16-token prompt at batch 1 and 8, less the same prompt with max_tokens 1, as tokens/s. Each
figure is the median of --repeat runs after one warm-up; each configuration runs in its own
process (an engine to itself). The vocabulary is small (--vocab) so the MoE layers, not the
LM head, are the cost. All runs use enforce_eager (no torch.compile), the same for the three.

    V=$(scripts/vllm-env.sh); $V/bin/python bench/vllm_engine.py --layers 4 --group 128

Prints a Markdown table; --json adds one JSON line per configuration.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

H, I, E, TOP_K = 2048, 768, 128, 8
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def config_dict(layers, vocab):
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab, "hidden_size": H, "intermediate_size": 6144,
        "moe_intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_experts": E,
        "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False,
    }


def make_models(root, layers, vocab, group):
    """Writes the three folders (once per shape); returns their paths."""
    import torch
    from safetensors.torch import save_file

    tag = f"L{layers}-V{vocab}-g{group}"
    paths = {k: os.path.join(root, f"{k}-{tag}") for k in ("w4a8moe", "vllm-int4", "bf16")}
    if all(os.path.exists(os.path.join(p, "config.json")) for p in paths.values()):
        return paths
    gen = torch.Generator().manual_seed(0)
    dense = {"model.embed_tokens.weight": torch.randn(vocab, H, generator=gen),
             "model.norm.weight": torch.ones(H),
             "lm_head.weight": torch.randn(vocab, H, generator=gen) / math.sqrt(H)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for name, (out, inp) in {"q_proj": (HEADS * HEAD_DIM, H),
                                 "k_proj": (KV_HEADS * HEAD_DIM, H),
                                 "v_proj": (KV_HEADS * HEAD_DIM, H),
                                 "o_proj": (H, HEADS * HEAD_DIM)}.items():
            dense[f"{p}self_attn.{name}.weight"] = torch.randn(out, inp, generator=gen) / math.sqrt(inp)
        dense[f"{p}self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        dense[f"{p}self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        dense[f"{p}input_layernorm.weight"] = torch.ones(H)
        dense[f"{p}post_attention_layernorm.weight"] = torch.ones(H)
        dense[f"{p}mlp.gate.weight"] = torch.randn(E, H, generator=gen) / math.sqrt(H)
    dense = {k: v.to(torch.bfloat16) for k, v in dense.items()}
    states = {k: dict(dense) for k in paths}
    for layer in range(layers):
        for e in range(E):
            base = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
                v = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
                s = (torch.rand(n, k // group, generator=gen) * 0.5 + 0.75) * (2.0 / (8 * math.sqrt(k)))
                sb = s.to(torch.bfloat16)  # and exactly so in GPTQ's float16 (same range)
                states["w4a8moe"][base + proj + ".weight"] = v
                states["w4a8moe"][base + proj + ".weight_scale"] = sb
                states["bf16"][base + proj + ".weight"] = (
                    v.float() * sb.float().repeat_interleave(group, 1)).to(torch.bfloat16)
                # GPTQ: qweight [k/8, n] (input k in bits 4 (k % 8) of word k/8, q = v + 8),
                # qzeros [k/g, n/8] (zero 8 stored as 7: checkpoint_format gptq), scales [k/g, n]
                q = (v.to(torch.int32) + 8).T.reshape(k // 8, 8, n)
                words = torch.zeros(k // 8, n, dtype=torch.int64)
                for j in range(8):
                    words |= q[:, j, :].to(torch.int64) << (4 * j)
                states["vllm-int4"][base + proj + ".qweight"] = (  # as int32 two's complement
                    words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)
                states["vllm-int4"][base + proj + ".qzeros"] = torch.full(
                    (k // group, n // 8), 0x77777777, dtype=torch.int32)
                states["vllm-int4"][base + proj + ".scales"] = sb.to(torch.float16).T.contiguous()
                states["vllm-int4"][base + proj + ".g_idx"] = torch.arange(k, dtype=torch.int32) // group
    quant = {
        "w4a8moe": {"quant_method": "compressed-tensors", "format": "int-quantized",
                    "quantization_status": "compressed", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {
                        "targets": [r"re:.*experts\.\d+\.(gate|up|down)_proj$"],
                        "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                    "strategy": "group", "group_size": group, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                              "strategy": "token", "dynamic": True}}}},
        "vllm-int4": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                      "sym": True, "checkpoint_format": "gptq",
                      "dynamic": {r"-:.*self_attn.*": {}, r"-:.*mlp\.gate$": {}}},
        "bf16": None,
    }
    for kind, path in paths.items():
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in states[kind].items()},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        config = config_dict(layers, vocab)
        if quant[kind] is not None:
            config["quantization_config"] = quant[kind]
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
    return paths


def run_one(path, args):
    """In this process: the engine on `path`; prints a JSON line of medians."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=args.prefill + args.decode + 32, max_num_seqs=8,
              max_num_batched_tokens=max(args.prefill, 1024), seed=0)

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
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "w4a8moe-vllm-bench"))
    parser.add_argument("--only", default="w4a8moe,vllm-int4,bf16")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        return run_one(args.run_one, args)
    paths = make_models(args.root, args.layers, args.vocab, args.group)
    rows = {}
    for kind in args.only.split(","):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; else vLLM asks for 92% of a node
        proc = subprocess.run([sys.executable, __file__, "--run-one", paths[kind]] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "prefill", "decode", "repeat")],
            capture_output=True, text=True, env=env)
        last = (proc.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            rows[kind] = json.loads(last)
        except json.JSONDecodeError:
            rows[kind] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        if proc.returncode != 0:
            rows[kind] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
        if args.json:
            print(json.dumps({"config": kind, **rows[kind]}), flush=True)
    print(f"\n{args.layers} layers, Qwen3-30B-A3B MoE shapes, group {args.group}, vocabulary "
          f"{args.vocab}, {os.cpu_count()} CPUs; medians of {args.repeat}\n")
    print("| weights / path | prefill 512 (s) | decode b1 (tok/s) | decode b8 (tok/s) |")
    print("|---|---|---|---|")
    for kind, r in rows.items():
        if "error" in r:
            print(f"| {kind} | {r['error']} | | |")
        else:
            print(f"| {kind} | {r['prefill_s']:.3f} | {r['decode_b1_tok_s']:.2f} | "
                  f"{r['decode_b8_tok_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
