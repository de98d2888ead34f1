"""Tiny W4A8 MoE checkpoints for the vLLM engine tests, written by compressed-tensors' own
compressor, and their float reference in Hugging Face transformers.

make_checkpoint() writes a folder vLLM loads: a transformers config (Qwen3-MoE or Mixtral with
small sizes), random weights whose activations are of order one, and the experts' gate, up and
down projections quantized with compressed-tensors' W4A8 scheme (int4 symmetric weights,
grouped or channel-wise; dynamic per-token int8 activations): scales from its
calculate_qparams, the weights put on its grid by its fake_quantize, then its ModelCompressor
compresses (int-quantized: int4 values in int8 `weight` tensors; pack-quantized: eight values a
word in `weight_packed`) and writes the quantization_config. The experts' weights are the
checkpoints' per-expert Linear modules (model.layers.L.mlp.experts.E.gate_proj, Mixtral's
block_sparse_moe.experts.E.w1/w3/w2), as llm-compressor writes them.

reference_logits() runs the same model in transformers, in float32, with the experts' weights
the fake-quantized (dequantized) ones: what the checkpoint means, without int8 activations.
"""

import json
import math
import os
import re

import torch

from ecosystem import quantize_with_qparams

FAMILIES = ("qwen3_moe", "mixtral", "llama4")


def order_one_(model, gen):
    """Order-one activations: unit-gain projections (every 2-D weight ~ N(0, 1/fan_in)), the
    embedding of unit rows; in place, from `gen`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))


def config_of(family, *, hidden=256, intermediate=128, experts=8, top_k=2, layers=2, vocab=256,
              max_positions=256):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=max_positions, tie_word_embeddings=False,
                  rms_norm_eps=1e-6)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(moe_intermediate_size=intermediate, intermediate_size=2 * hidden,
                              num_experts=experts, num_experts_per_tok=top_k,
                              norm_topk_prob=True, decoder_sparse_step=1, **common)
    if family == "mixtral":
        return MixtralConfig(intermediate_size=intermediate, num_local_experts=experts,
                             num_experts_per_tok=top_k, **common)
    if family == "llama4":  # top-1, sigmoid router weight applied to the input, a shared expert
        from transformers import Llama4TextConfig

        return Llama4TextConfig(intermediate_size=intermediate, intermediate_size_mlp=2 * hidden,
                                num_local_experts=experts, num_experts_per_tok=1,
                                interleave_moe_layer_step=1, **common)
    raise ValueError(f"family: expected one of {FAMILIES}, got {family}")


def _model_class(family):
    from transformers import Llama4ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM

    return {"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM,
            "llama4": Llama4ForCausalLM}[family]


def moe_block(model, layer):
    decoder = model.model.layers[layer]
    return decoder.feed_forward if hasattr(decoder, "feed_forward") else decoder.mlp


def experts_of(model, layer):
    """transformers' fused experts of a layer as (gate_up [E, 2I, H], down [E, H, I]) views
    (Llama 4 stores them transposed, for x @ W)."""
    experts = moe_block(model, layer).experts
    if isinstance(model.config, _llama4_config()):
        return experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    return experts.gate_up_proj, experts.down_proj


def _llama4_config():
    from transformers import Llama4TextConfig

    return Llama4TextConfig


def _expert_names(family, layer, expert):
    """The checkpoint's (gate, up, down) module names of one expert."""
    if family in ("qwen3_moe", "llama4"):
        block = "mlp" if family == "qwen3_moe" else "feed_forward"
        base = f"model.layers.{layer}.{block}.experts.{expert}"
        return f"{base}.gate_proj", f"{base}.up_proj", f"{base}.down_proj"
    base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return f"{base}.w1", f"{base}.w3", f"{base}.w2"


class _Tree(torch.nn.Module):
    """nn.Linear modules at dotted names (the experts as the checkpoint names them)."""

    def __init__(self, shapes):
        super().__init__()
        for name, (out, inp) in shapes.items():
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, torch.nn.Linear(inp, out, bias=False))


def make_checkpoint(folder, family="qwen3_moe", *, strategy="group", group_size=32,
                    fmt="int-quantized", seed=0, float_folder=None, symmetric=True,
                    activations=True, actorder=None, int4_attention=False, **sizes):
    """Writes the checkpoint; returns the float32 transformers model it means (the reference).
    float_folder: also write the same model unquantized (the experts' dequantized weights in
    float32, no quantization_config), which vLLM runs in bfloat16 to give the error floor.
    activations=False: W4A16 (no input_activations; vLLM's WNA16 method); symmetric=False:
    zero points; actorder: compressed-tensors' actorder field ("weight": static);
    int4_attention: the attention projections quantized too (dense int4 layers, as GPTQ / AWQ /
    W4A16 checkpoints of MoE models have them)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from safetensors.torch import save_file

    config = config_of(family, **sizes)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _model_class(family)(config).float().eval()
    H = config.hidden_size
    I = config.moe_intermediate_size if family == "qwen3_moe" else config.intermediate_size
    E = config.num_experts if family == "qwen3_moe" else config.num_local_experts
    # Llama 4's shared expert is a dense MLP of the same width: unquantized, as the targets say
    L = config.num_hidden_layers

    order_one_(model, gen)

    shapes = {}
    for layer in range(L):
        for e in range(E):
            gate, up, down = _expert_names(family, layer, e)
            shapes.update({gate: (I, H), up: (I, H), down: (H, I)})
    attention = {}
    if int4_attention:
        for name, module in model.named_modules():
            if re.fullmatch(r"model\.layers\.\d+\.self_attn\.[qkvo]_proj", name):
                attention[name] = module
                shapes[name] = tuple(module.weight.shape)
    tree = _Tree(shapes)
    with torch.no_grad():
        for name, module in tree.named_modules():
            if name in attention:
                module.weight.copy_(attention[name].weight)
            elif isinstance(module, torch.nn.Linear):
                w = torch.randn(module.weight.shape, generator=gen) * 1.5 / math.sqrt(
                    module.weight.shape[1])
                module.weight.copy_(w)

    extra = {} if actorder is None else {"actorder": actorder}
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                               group_size=group_size if strategy == "group" else None, **extra)
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                            dynamic=True) if activations else None
    targets = [r"re:.*experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"]
    if int4_attention:
        targets.append(r"re:.*self_attn\.(q|k|v|o)_proj$")
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=targets, weights=weights,
                                                     input_activations=acts)},
        format=fmt, ignore=["lm_head"])
    apply_quantization_config(tree, qconfig)
    plain = {}
    for name, module in tree.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        # bfloat16 scales (as the checkpoint stores them), so the reference uses the same ones
        plain[name] = quantize_with_qparams(module, weights, strategy, group_size,
                                            scale_dtype=torch.bfloat16).clone()
    want = 3 * E * L + len(attention)
    assert len(plain) == want, f"compressed-tensors quantized {len(plain)} of {want}"
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format=fmt)
    compressor.compress_model(tree)
    expert_state = {k: v.contiguous() for k, v in tree.state_dict().items()}

    # The reference: transformers' fused experts from the same dequantized weights.
    with torch.no_grad():
        for layer in range(L):
            gate_up, down_all = experts_of(model, layer)
            for e in range(E):
                gate, up, down = (plain[n] for n in _expert_names(family, layer, e))
                gate_up[e].copy_(torch.cat([gate, up]))
                down_all[e].copy_(down)
        for name, module in attention.items():
            module.weight.copy_(plain[name])

    state = {}
    for name, t in model.state_dict().items():
        if ".experts." in name or name.rsplit(".", 1)[0] in attention:
            continue
        if family == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        state[name] = t.to(torch.bfloat16).contiguous()
    for name, t in expert_state.items():
        state[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    config.architectures = [_model_class(family).__name__]
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    compressor.update_config(folder)
    if float_folder is not None:
        dense = {k: v for k, v in state.items() if ".experts." not in k
                 and k.rsplit(".", 1)[0] not in attention}
        dense.update({f"{name}.weight": w.contiguous() for name, w in plain.items()})
        os.makedirs(float_folder, exist_ok=True)
        save_file(dense, os.path.join(float_folder, "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(float_folder)
    # Non-expert weights are saved in bfloat16; the reference uses the same rounded values.
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if ".experts." not in name and name.rsplit(".", 1)[0] not in attention:
                t.copy_(t.to(torch.bfloat16).float())
    return model


def quantization_config(folder):
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)["quantization_config"]


def reference_logits(model, prompt):
    """The float32 logits of the next token at each position of `prompt` (token ids): [n, V]."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double()
