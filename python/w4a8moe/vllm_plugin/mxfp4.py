"""gpt-oss's MXFP4 MoE (GptOssMxfp4MoEMethod, `quant_method: mxfp4` with model_type gpt_oss):
e2m1 codes with an e8m0 exponent per 32 inputs, biases, gate and up interleaved, swigluoai with
its alpha and limit. vLLM's only CPU kernel for it (CPUExpertsMxfp4) needs AMX; w4a8moe runs it
on every CPU, the codes and exponents packed as the checkpoint holds them, the activations
quantized per token to int8.

Wrapped in vLLM's quantization.mxfp4 module: select_mxfp4_moe_backend (w4a8moe first),
mxfp4_round_up_hidden_size_and_intermediate_size (no padding: w4a8moe takes any multiple of
32) and the method's process_weights_after_loading."""

from . import core, patches

KIND = "MXFP4"
COMPUTES = (", as W4A8: the checkpoint's e2m1 codes and e8m0 scales exactly, the activations "
            "quantized per token to int8; not vLLM's CPU MXFP4 backend")


def _takes(config, *args, **kwargs) -> bool:
    """Whether w4a8moe takes the layer (select_mxfp4_moe_backend's arguments; the log line says
    so, or why not)."""
    activation_key = kwargs.get("activation_key", args[0] if args else None)
    if activation_key is not None:
        ok, reason = False, f"activation quantization {activation_key} (w4a8moe: dynamic int8)"
    else:
        ok, reason = core.check(config, 32)
    core.announce(KIND, config, ok, reason, COMPUTES if ok else "")
    return ok


def _is_our_backend(backend, *args, **kwargs) -> bool:
    return backend is core.Backend.W4A8MOE


def _sizes_as_they_are(backend, hidden_size, intermediate_size, *args, **kwargs):
    return hidden_size, intermediate_size


def install() -> None:
    from vllm.model_executor.layers.quantization import mxfp4 as method_module

    module = method_module.__name__
    patches.replace(module, "select_mxfp4_moe_backend", __name__,
                    lambda vllm: core.wrap(vllm, core.selected, _takes))
    patches.replace(module, "mxfp4_round_up_hidden_size_and_intermediate_size", __name__,
                    lambda vllm: core.wrap(vllm, _sizes_as_they_are, _is_our_backend))
    patches.replace(module, "GptOssMxfp4MoEMethod.process_weights_after_loading", __name__,
                    lambda vllm: core.wrap(vllm, _pack_layer, core.is_ours))


def _check_scales(layer) -> None:
    """An e8m0 exponent of 255 is NaN in the OCP MX format: refused, naming the tensor."""
    prefix = getattr(layer, "layer_name", type(layer).__name__)
    for name in ("w13_weight_scale", "w2_weight_scale"):
        bad = (getattr(layer, name).data == 255).flatten(1).any(1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"{prefix}: {name} of expert(s) {bad}: an e8m0 scale of 255 (NaN "
                             f"in the MX format); expected 0-254")


def _pack_layer(method, layer) -> None:
    from w4a8moe.vllm import pack_mxfp4_moe

    _check_scales(layer)
    _, layout = core.ACTIVATIONS[core.activation_name(method.moe)]
    if layout != "interleaved":
        raise ValueError(f"MXFP4 MoE with activation {core.activation_name(method.moe)}: "
                         f"w4a8moe packs gpt-oss's interleaved gate and up (swigluoai)")
    w13_packed, w2_packed = pack_mxfp4_moe(
        layer.w13_weight.data, layer.w2_weight.data, layer.w13_weight_scale.data,
        layer.w2_weight_scale.data, core.bias_of(layer, "w13_bias"),
        core.bias_of(layer, "w2_bias"))
    core.install_layer(method, layer, w13_packed, w2_packed, 32,
                       ["w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias"])
