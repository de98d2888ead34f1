"""The synthetic checkpoints of bench/vllm_engine.py: one real MoE model's shapes at any depth and
vocabulary, random weights of order-one outputs, the same weights written in each format a user
downloads. Written one layer at a time, one safetensors shard per layer with the index file
transformers and vLLM read, so that the memory a write takes is one layer's, never the model's:
Qwen3-30B-A3B whole (48 layers, vocabulary 151936) and gpt-oss-20b whole (24 layers, 201088)
write on a machine with less memory than their checkpoints.

  qwen3-30b-a3b  H 2048, MoE I 768, 128 experts, top-8; attention 32 heads, 4 KV heads, head 128.
                 Folders (kinds):
                   gptq   GPTQ 4-bit sym, group G, checkpoint_format gptq, the experts AND the
                          attention projections (as GPTQModel and AutoRound ship this model); the
                          router, norms, embedding and LM head bfloat16
                   w4a8   compressed-tensors W4A8 (int4 in int8 "int-quantized", dynamic per-token
                          int8 activations), the experts; attention bfloat16
                   w4a16  compressed-tensors W4A16 "pack-quantized", the experts; attention bf16
                   bf16   every weight decoded to bfloat16
  gpt-oss-20b    H 2880, I 2880, 32 experts, top-4, swigluoai with biases, interleaved gate and
                 up; attention 64 heads, 8 KV heads, head 64, sinks, sliding window 128 on every
                 other layer. Folders: mxfp4 (OpenAI's `_blocks` / `_scales` layout, attention
                 bfloat16, as OpenAI ships it), bf16 (the codes decoded).

  deepseek-v2-lite  H 2048, MoE I 1408, 64 routed experts + 2 shared (one MLP of 2816), top-6
                 of the softmax, no renormalisation; multi-head latent attention (16 heads, no
                 query compression, latent 512, rope 64, nope 128, value 128; the plain rope,
                 not the model's YaRN scaling), the first layer a dense MLP of 10944. Folders:
                 w4a16 (compressed-tensors W4A16 "pack-quantized", the routed experts; the rest
                 bfloat16), bf16.

Every folder of a shape holds the same model: the attention projections are int4 codes and group
scales in every folder (written as GPTQ in gptq, decoded to bfloat16 elsewhere), the experts'
codes are the same in every format. Each layer draws from its own seeded generator, so a layer's
weights do not depend on which folders are written or on the depth.
"""

import json
import math
import os
import shutil

SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite")
KINDS = {"qwen3-30b-a3b": ("gptq", "w4a8", "w4a16", "bf16"), "gpt-oss-20b": ("mxfp4", "bf16"),
         "deepseek-v2-lite": ("w4a16", "bf16")}

# Qwen3-30B-A3B and gpt-oss-20b: hidden, MoE intermediate, experts, top-k, heads, KV heads, head
QWEN3 = dict(H=2048, I=768, E=128, K=8, heads=32, kv=4, hd=128)
GPT_OSS = dict(H=2880, I=2880, E=32, K=4, heads=64, kv=8, hd=64)
# DeepSeek-V2-Lite: the same, the shared experts' width, the dense layer's, and the latent
# attention's sizes (latent, rope, nope and value head dims)
DEEPSEEK_V2_LITE = dict(H=2048, I=1408, E=64, K=6, shared=2816, dense=10944, heads=16,
                        latent=512, rope=64, nope=128, v=128)


class _Folder:
    """A checkpoint folder written shard by shard: add() tensors, flush() writes them as the next
    shard and forgets them; close() writes the index and config.json last, so a folder with a
    config.json is complete (an interrupted write is not mistaken for one)."""

    def __init__(self, path):
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
        self.path, self.tensors, self.weight_map, self.shards, self.bytes = path, {}, {}, 0, 0

    def add(self, name, tensor):
        # a copy of its own: safetensors refuses tensors that share storage (one expert of a
        # layer's batch, one norm vector written twice)
        self.tensors[name] = tensor.contiguous().clone()

    def flush(self):
        from safetensors.torch import save_file

        if not self.tensors:
            return
        shard = f"model-{self.shards:05d}.safetensors"
        save_file(self.tensors, os.path.join(self.path, shard), metadata={"format": "pt"})
        for name, t in self.tensors.items():
            self.weight_map[name] = shard
            self.bytes += t.numel() * t.element_size()
        self.shards += 1
        self.tensors = {}

    def close(self, config):
        self.flush()
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w",
                  encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.bytes}, "weight_map": self.weight_map}, f)
        with open(os.path.join(self.path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)


def _done(path):
    return os.path.exists(os.path.join(path, "config.json"))


def folder_gb(path):
    """The safetensors bytes of a written folder, in GB (10^9)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors")) / 1e9


def _normal(gen, out, inp):
    """A float32 [out, inp] matrix whose rows have norm about 1 (order-one outputs)."""
    import torch

    return torch.randn(out, inp, generator=gen) / math.sqrt(inp)


def _int4_words(gen, shape):
    """Random int4 codes as int32 words of eight: shape [..., n, k/8] (code j of a word in bits
    4j, the input-major packing of GPTQ's qweight transposed and of compressed-tensors'
    weight_packed). Every 32-bit pattern is eight valid codes."""
    import torch

    *lead, n, k = shape
    raw = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
    return raw.view(torch.int32)


def _unpack_words(words):
    """int32 words [..., n, k/8] -> int8 values [..., n, k] in [-8, 7] (code - 8)."""
    import torch

    b = words.view(torch.uint8)  # little-endian: code 2j in the low nibble of byte j
    v = torch.stack(((b & 15), (b >> 4)), dim=-1).flatten(-2)
    return v.to(torch.int8) - 8


def _scales(gen, shape, k):
    """Group scales about 1 / (4.6 sqrt(k)) (codes uniform in [-8, 7] have an RMS of 4.6), so
    rows have norm about 1; values exact in bfloat16 and float16 alike."""
    import torch

    s = (torch.rand(*shape, generator=gen) * 0.5 + 0.75) / (4.6 * math.sqrt(k))
    return s.to(torch.bfloat16)


def _decode(words, scales, group):
    """int4 words and bf16 group scales -> bfloat16 weights [..., n, k]."""
    import torch

    v = _unpack_words(words).float()
    return (v * scales.float().repeat_interleave(group, -1)).to(torch.bfloat16)


def _gptq_tensors(prefix, words, scales, group):
    """GPTQ (checkpoint_format gptq) tensors of one [n, k] int4 matrix: qweight [k/8, n] (input
    k in bits 4 (k % 8) of word k/8, code = value + 8), qzeros [k/g, n/8] (zero 8 stored as 7),
    scales [k/g, n] float16, g_idx [k]."""
    import torch

    n, k = words.shape[0], words.shape[1] * 8
    return {prefix + ".qweight": words.T,
            prefix + ".qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),
            prefix + ".scales": scales.to(torch.float16).T,
            prefix + ".g_idx": torch.arange(k, dtype=torch.int32) // group}


def _embeddings(folders, vocab, H):
    """The embedding, final norm and LM head (bfloat16 in every folder), as their own shard."""
    import torch

    gen = torch.Generator().manual_seed(12345)
    t = {"model.embed_tokens.weight": torch.randn(vocab, H, generator=gen).to(torch.bfloat16),
         "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "lm_head.weight": _normal(gen, vocab, H).to(torch.bfloat16)}
    for f in folders.values():
        for name, tensor in t.items():
            f.add(name, tensor)
        f.flush()


def _attention(gen, folders, p, s, group, gptq_kinds, bias):
    """One layer's q/k/v/o projections: int4 codes and group scales, written as GPTQ to the
    folders in gptq_kinds and decoded to bfloat16 elsewhere; biases (gpt-oss) zero."""
    import torch

    H, hd = s["H"], s["hd"]
    for name, (out, inp) in {"q_proj": (s["heads"] * hd, H), "k_proj": (s["kv"] * hd, H),
                             "v_proj": (s["kv"] * hd, H), "o_proj": (H, s["heads"] * hd)}.items():
        words = _int4_words(gen, (out, inp))
        scales = _scales(gen, (out, inp // group), inp)
        dense = None
        for kind, f in folders.items():
            if kind in gptq_kinds:
                for key, t in _gptq_tensors(f"{p}self_attn.{name}", words, scales, group).items():
                    f.add(key, t)
            else:
                dense = _decode(words, scales, group) if dense is None else dense
                f.add(f"{p}self_attn.{name}.weight", dense)
            if bias:
                f.add(f"{p}self_attn.{name}.bias", torch.zeros(out, dtype=torch.bfloat16))


def _folders(root, tag, kinds, vocab, H):
    """({kind: path}, {kind: _Folder} of those not written yet, with the vocabulary tables
    written to them)."""
    paths = {k: os.path.join(root, f"{k}-{tag}") for k in kinds}
    todo = {k: _Folder(p) for k, p in paths.items() if not _done(p)}
    if todo:
        _embeddings(todo, vocab, H)
    return paths, todo


def _write(root, tag, kinds, vocab, H, layers, write_layer, config, quant):
    """Writes (once) the folders root/<kind>-<tag> of `kinds`: the vocabulary tables, then each
    layer's shard, write_layer(layer, gen, prefix, todo) adding the layer's tensors to the folders
    being written (todo, {kind: _Folder}) from the layer's own seeded generator, then config.json:
    `config`, with the folder's quantization_config where `quant` ({kind: config}) has one.
    Returns {kind: path}."""
    import torch

    paths, todo = _folders(root, tag, kinds, vocab, H)
    if not todo:
        return paths
    for layer in range(layers):
        write_layer(layer, torch.Generator().manual_seed(1000 + layer), f"model.layers.{layer}.",
                    todo)
        for f in todo.values():
            f.flush()
    for kind, f in todo.items():
        f.close(dict(config, **({"quantization_config": quant[kind]} if kind in quant else {})))
    return paths


def _int4_experts(gen, todo, p, E, H, I, group):
    """One layer's routed experts (gate, up and down projections): int4 codes and group scales,
    written to each folder in its format (w4a8 int8 values, gptq, w4a16 packed words, bf16
    decoded)."""
    import torch

    for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
        words = _int4_words(gen, (E, n, k))
        scales = _scales(gen, (E, n, k // group), k)
        values = _unpack_words(words) if "w4a8" in todo else None
        dense = _decode(words, scales, group) if "bf16" in todo else None
        for e in range(E):
            name = f"{p}mlp.experts.{e}.{proj}"
            if "w4a8" in todo:
                todo["w4a8"].add(name + ".weight", values[e])
                todo["w4a8"].add(name + ".weight_scale", scales[e])
            if "gptq" in todo:
                for key, t in _gptq_tensors(name, words[e], scales[e], group).items():
                    todo["gptq"].add(key, t)
            if "w4a16" in todo:
                todo["w4a16"].add(name + ".weight_packed", words[e])
                todo["w4a16"].add(name + ".weight_scale", scales[e])
                todo["w4a16"].add(name + ".weight_shape", torch.tensor([n, k], dtype=torch.int32))
            if "bf16" in todo:
                todo["bf16"].add(name + ".weight", dense[e])


def _compressed_tensors(fmt, group, **group_0):
    """compressed-tensors' quantization_config of the routed experts' int4 weights (symmetric,
    groups of `group`) in format `fmt`; group_0: more of the group's schemes (activations)."""
    experts = r"re:.*experts\.\d+\.(gate|up|down)_proj$"  # not the shared experts
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": [experts], "weights": weights, **group_0}}}


def qwen3(root, layers, vocab, group, kinds):
    """Writes (once) the Qwen3-30B-A3B folders of `kinds`; returns {kind: path}."""
    import torch

    s = QWEN3
    H, I, E, HD = s["H"], s["I"], s["E"], s["hd"]
    ones = torch.ones(H, dtype=torch.bfloat16)

    def write_layer(layer, gen, p, todo):
        _attention(gen, todo, p, s, group, ("gptq",), bias=False)
        router = _normal(gen, E, H).to(torch.bfloat16)
        for f in todo.values():
            f.add(f"{p}self_attn.q_norm.weight", torch.ones(HD, dtype=torch.bfloat16))
            f.add(f"{p}self_attn.k_norm.weight", torch.ones(HD, dtype=torch.bfloat16))
            f.add(f"{p}input_layernorm.weight", ones)
            f.add(f"{p}post_attention_layernorm.weight", ones)
            f.add(f"{p}mlp.gate.weight", router)
        _int4_experts(gen, todo, p, E, H, I, group)

    quant = {
        "w4a8": _compressed_tensors("int-quantized", group, input_activations={
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
            "dynamic": True}),
        # the router stays bfloat16 (GPTQModel leaves mlp.gate alone)
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": True, "checkpoint_format": "gptq", "dynamic": {r"-:.*mlp\.gate$": {}}},
        "w4a16": _compressed_tensors("pack-quantized", group),
    }
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab, "hidden_size": H, "intermediate_size": 6144,
        "moe_intermediate_size": I, "num_hidden_layers": layers,
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"], "head_dim": HD,
        "num_experts": E, "num_experts_per_tok": s["K"], "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    }
    return _write(root, f"qwen3-L{layers}-V{vocab}-g{group}", kinds, vocab, H, layers,
                  write_layer, config, quant)


def gpt_oss(root, layers, vocab, kinds):
    """Writes (once) the gpt-oss-20b folders of `kinds`; returns {kind: path}."""
    import torch

    s = GPT_OSS
    H, I, E, HEADS = s["H"], s["I"], s["E"], s["heads"]
    ones = torch.ones(H, dtype=torch.bfloat16)

    def write_layer(layer, gen, p, todo):
        _attention(gen, todo, p, s, 32, (), bias=True)
        router = _normal(gen, E, H).to(torch.bfloat16)
        for f in todo.values():
            f.add(f"{p}self_attn.sinks", torch.zeros(HEADS, dtype=torch.bfloat16))
            f.add(f"{p}input_layernorm.weight", ones)
            f.add(f"{p}post_attention_layernorm.weight", ones)
            f.add(f"{p}mlp.router.weight", router)
            f.add(f"{p}mlp.router.bias", torch.zeros(E, dtype=torch.bfloat16))
        prefix = f"{p}mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=gen,
                                   dtype=torch.uint8)
            # e2m1 codes have an RMS of ~2.9: exponents 2^-8 .. 2^-6 give rows of about
            # 1/sqrt(cols) (order-one outputs)
            scales = torch.randint(119, 122, (E, rows, cols // 32), generator=gen,
                                   dtype=torch.uint8)
            bias = (torch.randn(E, rows, generator=gen) * 0.1).to(torch.bfloat16)
            if "mxfp4" in todo:
                todo["mxfp4"].add(prefix + name + "_blocks", blocks)
                todo["mxfp4"].add(prefix + name + "_scales", scales)
                todo["mxfp4"].add(prefix + name + "_bias", bias)
            if "bf16" in todo:
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                todo["bf16"].add(prefix + name,
                                 convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
                todo["bf16"].add(prefix + name + "_bias", bias)

    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab,
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": s["kv"], "head_dim": s["hd"],
        "num_local_experts": E, "num_experts_per_tok": s["K"], "experts_per_token": s["K"],
        "sliding_window": 128, "layer_types": ["sliding_attention" if i % 2 == 0 else
                                               "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]}
    return _write(root, f"gpt-oss-L{layers}-V{vocab}", kinds, vocab, H, layers, write_layer,
                  config, {"mxfp4": quant})


def deepseek_v2_lite(root, layers, vocab, group, kinds):
    """Writes (once) the DeepSeek-V2-Lite folders of `kinds`; returns {kind: path}. Layer 0 is
    the dense MLP, as in the model; the others are MoE layers."""
    import torch

    s = DEEPSEEK_V2_LITE
    H, I, E, heads = s["H"], s["I"], s["E"], s["heads"]
    ones = torch.ones(H, dtype=torch.bfloat16)

    def write_layer(layer, gen, p, todo):
        dense = {  # bfloat16 in every folder: the latent attention, the dense or shared MLP
            "self_attn.q_proj": (heads * (s["nope"] + s["rope"]), H),
            "self_attn.kv_a_proj_with_mqa": (s["latent"] + s["rope"], H),
            "self_attn.kv_b_proj": (heads * (s["nope"] + s["v"]), s["latent"]),
            "self_attn.o_proj": (H, heads * s["v"])}
        mlp = "mlp." if layer == 0 else "mlp.shared_experts."
        width = s["dense"] if layer == 0 else s["shared"]
        dense.update({mlp + "gate_proj": (width, H), mlp + "up_proj": (width, H),
                      mlp + "down_proj": (H, width)})
        if layer > 0:
            dense["mlp.gate"] = (E, H)
        for name, (out, inp) in dense.items():
            weight = _normal(gen, out, inp).to(torch.bfloat16)
            for f in todo.values():
                f.add(f"{p}{name}.weight", weight)
        for f in todo.values():
            f.add(f"{p}self_attn.kv_a_layernorm.weight",
                  torch.ones(s["latent"], dtype=torch.bfloat16))
            f.add(f"{p}input_layernorm.weight", ones)
            f.add(f"{p}post_attention_layernorm.weight", ones)
        if layer > 0:
            _int4_experts(gen, todo, p, E, H, I, group)

    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": vocab, "hidden_size": H, "intermediate_size": s["dense"],
        "moe_intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "n_routed_experts": E, "n_shared_experts": 2,
        "num_experts_per_tok": s["K"], "routed_scaling_factor": 1.0, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "scoring_func": "softmax",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": s["latent"],
        "q_lora_rank": None, "qk_rope_head_dim": s["rope"], "qk_nope_head_dim": s["nope"],
        "v_head_dim": s["v"], "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False,
    }
    return _write(root, f"deepseek-v2-lite-L{layers}-V{vocab}-g{group}", kinds, vocab, H, layers,
                  write_layer, config, {"w4a16": _compressed_tensors("pack-quantized", group)})


def estimate_gb(shape, kind, layers, vocab, group=128):
    """The checkpoint's size in GB before it is written (the runner skips rows that cannot fit
    the machine's memory)."""
    if shape == "deepseek-v2-lite":  # layer 0 dense, the others MoE; bfloat16 but the experts
        s = DEEPSEEK_V2_LITE
        attention = 2 * (s["heads"] * (s["nope"] + s["rope"]) * s["H"] + (s["latent"] + s["rope"])
                         * s["H"] + s["heads"] * (s["nope"] + s["v"]) * s["latent"]
                         + s["H"] * s["heads"] * s["v"])
        moe = (s["E"] * 3 * s["H"] * s["I"] * {"w4a16": 0.5 + 2 / group, "bf16": 2}[kind]
               + 2 * (3 * s["shared"] * s["H"] + s["E"] * s["H"]))
        return (layers * attention + 2 * 3 * s["dense"] * s["H"] + (layers - 1) * moe
                + 2 * vocab * s["H"] * 2) / 1e9
    if shape == "qwen3-30b-a3b":
        s = QWEN3
        experts = s["E"] * 3 * s["H"] * s["I"]
        attention = 2 * s["H"] * (s["heads"] + s["kv"]) * s["hd"]
        per_weight = {"gptq": 0.5 + 2 / group, "w4a16": 0.5 + 2 / group,
                      "w4a8": 1 + 2 / group, "bf16": 2}[kind]
        attn_bytes = (0.5 + 2 / group) if kind == "gptq" else 2
    else:
        s = GPT_OSS
        experts = s["E"] * 3 * s["H"] * s["I"]
        attention = 2 * s["H"] * (s["heads"] + s["kv"]) * s["hd"]
        per_weight = {"mxfp4": 0.5 + 1 / 32, "bf16": 2}[kind]
        attn_bytes = 2
    layer = experts * per_weight + attention * attn_bytes
    return (layers * layer + 2 * vocab * s["H"] * 2) / 1e9
