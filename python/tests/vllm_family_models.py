"""Tiny W4A16 checkpoints of the MoE families whose routing, attention or shared experts differ
from Qwen3-MoE and Mixtral, for the vLLM engine tests (test_vllm_families.py), and their float
reference in Hugging Face transformers.

make_checkpoint() builds the model with transformers' own classes (GLM-4.5, DeepSeek-V2-Lite, a
grouped DeepSeek-V2, DeepSeek-V3, Qwen3-Next; hidden 256, 8 routed experts of width 128, top-2,
vocabulary 256, a dense first layer where the family has one), random weights whose activations
are of order one, and writes what vLLM loads: the routed experts' gate, up and down projections
as compressed-tensors W4A16 (int4 symmetric, group 32, `pack-quantized`), their scales from
compressed-tensors' calculate_qparams and the weights put on its grid by its fake_quantize, then
compressed by its ModelCompressor (as vllm_models.make_checkpoint does for the other families);
everything else (attention, routers and their correction biases, shared experts, dense layers)
in bfloat16. The reference is the same transformers model in float32 with the experts' weights
the dequantized ones and every other weight rounded to bfloat16 as the file holds it.

router_margins() measures, in the reference, how close each token's routing is to choosing other
experts: the engine tests excuse a position off the bound only where that margin is small.
"""

import math
import os

import torch

from ecosystem import quantize_with_qparams
import vllm_models
from vllm_models import _Tree

# family: (transformers' class, routing as vLLM's layer holds it: scoring function, correction
# bias, multi-head latent attention)
FAMILIES = {
    "glm4_moe": ("Glm4MoeForCausalLM", "sigmoid", True, False),
    "deepseek_v2_lite": ("DeepseekV2ForCausalLM", "softmax", False, True),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "softmax", False, True),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "sigmoid", True, True),
    "qwen3_next": ("Qwen3NextForCausalLM", "softmax", False, False),
}


def config_of(family, *, hidden=256, intermediate=128, experts=8, top_k=2, vocab=256):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  moe_intermediate_size=intermediate, num_experts_per_tok=top_k,
                  num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    # multi-head latent attention as vLLM's CPU backend takes it: latent 512 + rope 64
    mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
               num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
               n_routed_experts=experts)
    if family == "glm4_moe":  # GLM-4.5 / 4.5-Air: noaux_tc routing in one group, scaling 2.5
        return transformers.Glm4MoeConfig(
            num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=2, head_dim=64,
            n_routed_experts=experts, n_shared_experts=1, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True, **common)
    if family == "deepseek_v2_lite":  # one group: plain top-k of the softmax, no scaling
        return transformers.DeepseekV2Config(
            q_lora_rank=None, n_shared_experts=2, topk_method="greedy", n_group=1,
            topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, **mla, **common)
    if family == "deepseek_v2":  # V2-Lite's weights (the same shapes and seed) routed as V2:
        # group-limited greedy, the top-2 in the best of 2 groups (a group scored by its best
        # expert: with top-2 of 8 the limit changes choices only when fewer groups are kept
        # than experts chosen), scaled by 2
        return transformers.DeepseekV2Config(
            q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=2,
            topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0, **mla, **common)
    if family == "deepseek_v3":  # noaux_tc: sigmoid + bias, the best 2 of 4 groups, scaled
        return transformers.DeepseekV3Config(
            q_lora_rank=128, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid", **mla,
            **common)
    if family == "qwen3_next":  # gated delta-net, then gated attention; a gated shared expert
        return transformers.Qwen3NextConfig(
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            num_experts=experts, shared_expert_intermediate_size=intermediate,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family}")


def moe_blocks(model):
    """{decoder layer index: its MoE block} (the blocks with routed experts)."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts")}


def _expert_names(layer, expert):
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj", f"{base}.up_proj", f"{base}.down_proj"


def make_checkpoint(folder, family, *, group_size=32, seed=0, float_folder=None):
    """Writes the W4A16 checkpoint of `family` in `folder`; returns the float32 transformers
    model it means (the reference). float_folder: also the same model unquantized (the experts'
    dequantized weights, no quantization_config), which vLLM runs in bfloat16: the floor."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from safetensors.torch import save_file

    config = config_of(family)
    cls = getattr(transformers, FAMILIES[family][0])
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    blocks = moe_blocks(model)
    H = config.hidden_size
    I = config.moe_intermediate_size
    E = blocks[min(blocks)].gate.weight.shape[0]

    # Order-one activations; correction biases of the size of the sigmoid scores' spread, so
    # that they change choices.
    vllm_models.order_one_(model, gen)
    with torch.no_grad():
        for block in blocks.values():
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.1 * torch.rand(bias.shape, generator=gen))

    shapes = {}
    for layer in blocks:
        for e in range(E):
            gate, up, down = _expert_names(layer, e)
            shapes.update({gate: (I, H), up: (I, H), down: (H, I)})
    tree = _Tree(shapes)
    with torch.no_grad():
        for module in tree.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 1.5
                                    / math.sqrt(module.weight.shape[1]))

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=group_size)
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(
            targets=[r"re:.*experts\.\d+\.(gate_proj|up_proj|down_proj)$"],
            weights=weights)},
        format="pack-quantized", ignore=["lm_head"])
    apply_quantization_config(tree, qconfig)
    plain = {}
    for name, module in tree.named_modules():
        if hasattr(module, "weight_scale"):
            # bfloat16 scales (as the checkpoint stores them), so the reference uses the same
            plain[name] = quantize_with_qparams(module, weights, "group", group_size,
                                                scale_dtype=torch.bfloat16).clone()
    assert len(plain) == 3 * E * len(blocks), f"compressed-tensors quantized {len(plain)}"
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format="pack-quantized")
    compressor.compress_model(tree)
    expert_state = {k: v.contiguous() for k, v in tree.state_dict().items()}

    # The reference: transformers' fused experts from the same dequantized weights.
    with torch.no_grad():
        for layer, block in blocks.items():
            for e in range(E):
                gate, up, down = (plain[n] for n in _expert_names(layer, e))
                block.experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
                block.experts.down_proj[e].copy_(down)

    state = {name: t.to(torch.bfloat16).contiguous()
             for name, t in model.state_dict().items() if ".experts." not in name}
    config.architectures = [cls.__name__]
    if float_folder is not None:
        dense = dict(state)
        dense.update({f"{name}.weight": w.contiguous() for name, w in plain.items()})
        os.makedirs(float_folder, exist_ok=True)
        save_file(dense, os.path.join(float_folder, "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(float_folder)
    for name, t in expert_state.items():
        state[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    compressor.update_config(folder)
    # Non-expert weights are saved in bfloat16; the reference uses the same rounded values.
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if ".experts." not in name:
                t.copy_(t.to(torch.bfloat16).float())
    return model


def routing_margin(logits, top_k, scoring_func, groups=1, topk_group=1, bias=None):
    """Per token, the smallest gap at a decision of vLLM's routing (the k-th and next expert's
    selection score among the kept groups, and the topk_group-th and next group's score), in
    the units of the scores (softmax probabilities, or sigmoid scores plus the bias)."""
    logits = logits.float()
    scores = torch.softmax(logits, -1) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    tokens, experts = choice.shape
    gaps = []
    if topk_group < groups:
        per_group = choice.view(tokens, groups, -1)
        group_scores = (per_group.topk(2, dim=-1)[0].sum(-1) if bias is not None
                        else per_group.max(-1).values)
        ranked = group_scores.sort(-1, descending=True).values
        gaps.append(ranked[:, topk_group - 1] - ranked[:, topk_group])
        kept = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(
            1, group_scores.topk(topk_group, dim=-1)[1], True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // groups, 1),
                                    float("-inf"))
    ranked = choice.sort(-1, descending=True).values
    gaps.append(ranked[:, top_k - 1] - ranked[:, top_k])
    return torch.stack(gaps).min(0).values


def router_margins(model, family, prompt):
    """[positions] the smallest routing_margin of each prompt token over the model's MoE
    layers, from the router inputs of a float32 forward pass of the reference."""
    _, scoring, _, _ = FAMILIES[family]
    config = model.config
    groups = getattr(config, "n_group", None) or 1
    topk_group = getattr(config, "topk_group", None) or 1
    inputs, hooks = {}, []
    for layer, block in moe_blocks(model).items():
        def keep(_module, args, _layer=layer):
            inputs[_layer] = args[0].reshape(-1, args[0].shape[-1]).detach().float()
        hooks.append(block.gate.register_forward_pre_hook(keep))
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    margins = []
    for layer, block in moe_blocks(model).items():
        logits = inputs[layer] @ block.gate.weight.float().t()
        bias = getattr(block.gate, "e_score_correction_bias", None)
        margins.append(routing_margin(logits, config.num_experts_per_tok, scoring, groups,
                                      topk_group, bias))
    return torch.stack(margins).min(0).values
