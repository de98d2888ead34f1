"""The synthetic checkpoints of bench/vllm_engine.py: one model shape, a few layers, random
weights of order-one outputs, the same experts written in each format a user downloads. The
attention, norms, routers and LM head are bfloat16 in every folder (only the experts differ), so
that the comparison is between MoE paths.

  qwen3-30b-a3b  H 2048, MoE I 768, 128 experts, top-8; attention 32 heads, 4 KV heads, head 128.
                 Folders: w4a8 (compressed-tensors int-quantized W4A8, group G), gptq (GPTQ
                 4-bit sym, group G, checkpoint_format gptq), w4a16 (compressed-tensors
                 pack-quantized W4A16, group G), bf16 (the same int4 weights dequantized).
  gpt-oss-20b    H 2880, I 2880, 32 experts, top-4, swigluoai with biases, interleaved gate and
                 up; attention 64 heads, 8 KV heads, head 64, sinks, sliding window 128 on every
                 other layer. Folders: mxfp4 (OpenAI's `_blocks` / `_scales` layout), bf16 (the
                 codes decoded by transformers' convert_moe_packed_tensors).
"""

import json
import math
import os

SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")


def _save(path, tensors, config):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def _done(paths):
    return all(os.path.exists(os.path.join(p, "config.json")) for p in paths.values())


def _linear(gen, out, inp):
    import torch

    return torch.randn(out, inp, generator=gen) / math.sqrt(inp)


def _common(gen, layers, vocab, hidden, heads, kv_heads, head_dim, attention_bias):
    """The embedding, final norm, LM head and each layer's attention and norms (float32)."""
    import torch

    H = hidden
    t = {"model.embed_tokens.weight": torch.randn(vocab, H, generator=gen),
         "model.norm.weight": torch.ones(H), "lm_head.weight": _linear(gen, vocab, H)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for name, (out, inp) in {"q_proj": (heads * head_dim, H),
                                 "k_proj": (kv_heads * head_dim, H),
                                 "v_proj": (kv_heads * head_dim, H),
                                 "o_proj": (H, heads * head_dim)}.items():
            t[f"{p}self_attn.{name}.weight"] = _linear(gen, out, inp)
            if attention_bias:
                t[f"{p}self_attn.{name}.bias"] = torch.zeros(out)
        t[f"{p}input_layernorm.weight"] = torch.ones(H)
        t[f"{p}post_attention_layernorm.weight"] = torch.ones(H)
    return t


def _pack_words(values, along):
    """int4 codes in [0, 15] -> int32 words of eight along dimension `along` (code j of a word
    in bits 4j), as two's complement int32."""
    import torch

    v = values.to(torch.int64).movedim(along, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        words |= v[..., j] << (4 * j)
    words = (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)
    return words.movedim(-1, along)


def qwen3(root, layers, vocab, group):
    """Writes (once) the four Qwen3-30B-A3B folders; returns {kind: path}."""
    import torch

    H, I, E, TOP_K, HEADS, KV, HD = 2048, 768, 128, 8, 32, 4, 128
    tag = f"qwen3-L{layers}-V{vocab}-g{group}"
    paths = {k: os.path.join(root, f"{k}-{tag}") for k in ("w4a8", "gptq", "w4a16", "bf16")}
    if _done(paths):
        return paths
    gen = torch.Generator().manual_seed(0)
    dense = _common(gen, layers, vocab, H, HEADS, KV, HD, attention_bias=False)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        dense[f"{p}self_attn.q_norm.weight"] = torch.ones(HD)
        dense[f"{p}self_attn.k_norm.weight"] = torch.ones(HD)
        dense[f"{p}mlp.gate.weight"] = _linear(gen, E, H)
    dense = {k: v.to(torch.bfloat16) for k, v in dense.items()}
    states = {k: dict(dense) for k in paths}
    for layer in range(layers):
        for e in range(E):
            base = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H),
                                 "down_proj": (H, I)}.items():
                v = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
                s = (torch.rand(n, k // group, generator=gen) * 0.5 + 0.75) * (
                    2.0 / (8 * math.sqrt(k)))
                sb = s.to(torch.bfloat16)  # and exactly so in GPTQ's float16 (same range)
                name = base + proj
                states["w4a8"][name + ".weight"] = v
                states["w4a8"][name + ".weight_scale"] = sb
                states["bf16"][name + ".weight"] = (
                    v.float() * sb.float().repeat_interleave(group, 1)).to(torch.bfloat16)
                # GPTQ: qweight [k/8, n] (input k in bits 4 (k % 8) of word k/8, q = v + 8),
                # qzeros [k/g, n/8] (zero 8 stored as 7: checkpoint_format gptq), scales [k/g, n]
                states["gptq"][name + ".qweight"] = _pack_words((v + 8).T, 0)
                states["gptq"][name + ".qzeros"] = torch.full((k // group, n // 8), 0x77777777,
                                                              dtype=torch.int32)
                states["gptq"][name + ".scales"] = sb.to(torch.float16).T.contiguous()
                states["gptq"][name + ".g_idx"] = torch.arange(k, dtype=torch.int32) // group
                # compressed-tensors pack-quantized: weight_packed [n, k/8] (the same nibbles
                # along the inputs), weight_scale [n, k/g], weight_shape [n, k]
                states["w4a16"][name + ".weight_packed"] = _pack_words(v + 8, 1)
                states["w4a16"][name + ".weight_scale"] = sb
                states["w4a16"][name + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
    experts = r"re:.*experts\.\d+\.(gate|up|down)_proj$"
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group, "dynamic": False}
    quant = {
        "w4a8": {"quant_method": "compressed-tensors", "format": "int-quantized",
                 "quantization_status": "compressed", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {
                     "targets": [experts], "weights": weights,
                     "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                           "strategy": "token", "dynamic": True}}}},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": True, "checkpoint_format": "gptq",
                 "dynamic": {r"-:.*self_attn.*": {}, r"-:.*mlp\.gate$": {}}},
        "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": [experts], "weights": weights}}},
    }
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab, "hidden_size": H, "intermediate_size": 6144,
        "moe_intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": HD, "num_experts": E,
        "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False,
    }
    for kind, path in paths.items():
        _save(path, states[kind], dict(config, **(
            {"quantization_config": quant[kind]} if kind in quant else {})))
    return paths


def gpt_oss(root, layers, vocab):
    """Writes (once) the two gpt-oss-20b folders; returns {kind: path}."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    H, I, E, TOP_K, HEADS, KV, HD = 2880, 2880, 32, 4, 64, 8, 64
    tag = f"gpt-oss-L{layers}-V{vocab}"
    paths = {k: os.path.join(root, f"{k}-{tag}") for k in ("mxfp4", "bf16")}
    if _done(paths):
        return paths
    gen = torch.Generator().manual_seed(0)
    common = _common(gen, layers, vocab, H, HEADS, KV, HD, attention_bias=True)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        common[f"{p}self_attn.sinks"] = torch.zeros(HEADS)
        common[f"{p}mlp.router.weight"] = _linear(gen, E, H)
        common[f"{p}mlp.router.bias"] = torch.zeros(E)
    common = {k: v.to(torch.bfloat16) for k, v in common.items()}
    states = {k: dict(common) for k in paths}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=gen,
                                   dtype=torch.uint8)
            # e2m1 codes have an RMS of ~2.9: exponents 2^-8 .. 2^-6 give rows of about
            # 1/sqrt(cols) (order-one outputs)
            scales = torch.randint(119, 122, (E, rows, cols // 32), generator=gen,
                                   dtype=torch.uint8)
            bias = (torch.randn(E, rows, generator=gen) * 0.1).to(torch.bfloat16)
            states["mxfp4"][prefix + name + "_blocks"] = blocks
            states["mxfp4"][prefix + name + "_scales"] = scales
            states["mxfp4"][prefix + name + "_bias"] = bias
            states["bf16"][prefix + name] = convert_moe_packed_tensors(
                blocks, scales, dtype=torch.bfloat16)
            states["bf16"][prefix + name + "_bias"] = bias
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab,
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
        "num_local_experts": E, "num_experts_per_tok": TOP_K, "experts_per_token": TOP_K,
        "sliding_window": 128, "layer_types": ["sliding_attention" if i % 2 == 0 else
                                               "full_attention" for i in range(layers)],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]}
    _save(paths["mxfp4"], states["mxfp4"], dict(config, quantization_config=quant))
    _save(paths["bf16"], states["bf16"], config)
    return paths
