"""Tiny GPTQ, AWQ and gpt-oss MXFP4 MoE checkpoints for the vLLM engine tests, with their float
reference in transformers.

GPTQ and AWQ: the experts of a compressed-tensors W4A16 checkpoint (written by compressed-tensors'
own compressor, vllm_models.make_checkpoint) re-encoded in those formats by vLLM's own packers
(quant_utils.gptq_pack, pack_cols, awq_pack): the same integers, zero points and scales (fp16, as
those formats store them; the bf16 scales are exact in fp16), so the transformers reference of
the compressed-tensors checkpoint is theirs too. The attention and router stay unquantized
(GPTQ's modules_in_block_to_quantize, AWQ's modules_to_not_convert), as in the W4A8 tests.

gpt-oss MXFP4: a tiny GptOssForCausalLM whose experts are random e2m1 codes and e8m0 exponents
in OpenAI's layout (`*_blocks` U8 [E, out, in/32, 16], `*_scales` U8 [E, out, in/32]); the
reference holds transformers' own decoding of the same bytes (convert_moe_packed_tensors).
"""

import json
import math
import os
import re

import torch

import vllm_models


def _unpack(words, along_rows):
    """compressed-tensors int32 words -> unsigned nibbles: along the columns ([N, K/8] ->
    [N, K]) or the rows ([N/8, G] -> [N, G]); value 8w + i in bits 4i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if along_rows:
        q = (words.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15
        return q.reshape(words.shape[0] * 8, words.shape[1])
    q = (words.unsqueeze(-1) >> shifts) & 15
    return q.reshape(words.shape[0], words.shape[1] * 8)


def reencode(ct_folder, folder, fmt, *, group_size, symmetric, int4_attention=False,
             dynamic=None):
    """Writes `folder`: the compressed-tensors W4A16 `pack-quantized` checkpoint in ct_folder
    with its experts (and, int4_attention, its attention projections) re-encoded as fmt
    ("gptq", "gptq_v2" or "awq"). dynamic: GPTQModel's per-module rules for the GPTQ config."""
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils import quant_utils

    def per(fn, m):  # vLLM's packers take [K, N]
        return fn(m.contiguous(), 4, m.shape[0], m.shape[1])

    state = load_file(os.path.join(ct_folder, "model.safetensors"))
    out = {}
    for name, t in state.items():
        if not name.endswith(".weight_packed"):
            if not re.search(r"\.weight_(scale|zero_point|shape)$", name):
                out[name] = t
            continue
        base = name[: -len(".weight_packed")]
        q = _unpack(t, along_rows=False)                      # [N, K], unsigned (value + 8)
        scale = state[base + ".weight_scale"].to(torch.float16)  # [N, G]
        assert torch.equal(scale.to(torch.bfloat16), state[base + ".weight_scale"])
        n, k = q.shape
        groups = scale.shape[1]
        if symmetric:
            zero = torch.full((n, groups), 8, dtype=torch.int32)
        else:
            zero = _unpack(state[base + ".weight_zero_point"], along_rows=True)[:n]
        if fmt == "awq":
            out[base + ".qweight"] = per(quant_utils.awq_pack, q.t())      # [K, N/8]
            out[base + ".qzeros"] = per(quant_utils.awq_pack, zero.t())    # [G, N/8]
        else:
            stored = zero - 1 if fmt == "gptq" else zero
            assert bool((stored >= 0).all()), "a zero of 0 has no gptq (v1) encoding"
            out[base + ".qweight"] = per(quant_utils.gptq_pack, q.t())     # [K/8, N]
            out[base + ".qzeros"] = per(quant_utils.pack_cols, stored.t())  # [G, N/8]
            g = k if group_size == -1 else group_size
            out[base + ".g_idx"] = (torch.arange(k) // g).to(torch.int32)
        out[base + ".scales"] = scale.t().contiguous()                     # [G, N]
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ct_folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if fmt == "awq":
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": (
                [] if int4_attention else ["self_attn"]) + ["mlp.gate", "lm_head"]}
    else:
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": symmetric,
            "desc_act": False, "checkpoint_format": fmt, "lm_head": False,
            "modules_in_block_to_quantize": ["mlp.experts"] + (
                [f"self_attn.{p}_proj" for p in "qkvo"] if int4_attention else [])}
        if dynamic is not None:
            config["quantization_config"]["dynamic"] = dynamic
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def make_gpt_oss(folder, *, hidden=256, intermediate=128, experts=8, top_k=2, layers=2,
                 vocab=256, seed=0, float_folder=None):
    """Writes a tiny gpt-oss MXFP4 checkpoint; returns its float32 transformers reference.
    float_folder: the same model with the experts decoded, in bfloat16 (vLLM's floor)."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        intermediate_size=intermediate, num_local_experts=experts,
        num_experts_per_tok=top_k, sliding_window=16, layer_types=["full_attention"] * layers,
        tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            if name.endswith("sinks"):
                p.zero_()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    dense = dict(tensors)
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        experts_module = model.model.layers[layer].mlp.experts
        for name, rows, cols in (("gate_up_proj", 2 * intermediate, hidden),
                                 ("down_proj", hidden, intermediate)):
            blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen,
                                   dtype=torch.uint8)
            # 2^-5 .. 2^-3 for the gate/up (order-one pre-activations), 2^-6 .. 2^-4 for down
            low = 122 if name == "gate_up_proj" else 121
            scales = torch.randint(low, low + 3, (experts, rows, cols // 32), generator=gen,
                                   dtype=torch.uint8)
            bias = torch.randn(experts, rows, generator=gen) * 0.1
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"] = blocks
            tensors[prefix + name + "_scales"] = scales
            tensors[prefix + name + "_bias"] = bias.to(torch.bfloat16)
            decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            with torch.no_grad():
                getattr(experts_module, name).copy_(decoded)
                getattr(experts_module, name + "_bias").copy_(bias.to(torch.bfloat16).float())
            dense[prefix + name] = decoded.to(torch.bfloat16)
            dense[prefix + name + "_bias"] = bias.to(torch.bfloat16)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if float_folder is not None:
        os.makedirs(float_folder, exist_ok=True)
        save_file(dense, os.path.join(float_folder, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(float_folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "lm_head"]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with torch.no_grad():  # the reference uses the bfloat16 values the file holds
        for name, t in model.state_dict().items():
            if ".experts." not in name:
                t.copy_(t.to(torch.bfloat16).float())
    return model


__all__ = ["make_gpt_oss", "reencode", "vllm_models"]
