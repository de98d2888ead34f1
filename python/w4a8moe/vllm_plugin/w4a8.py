"""compressed-tensors W4A8 int4 MoE (CompressedTensorsW4A8Int8MoEMethod: int4 symmetric
weights, channel-wise or grouped, dynamic per-token int8 activations): vLLM's own kernel for it
runs only on Arm; w4a8moe runs it on every CPU.

Wrapped in vLLM's compressed_tensors_moe_w4a8_int8 module: select_w4a8_int8_moe_backend (w4a8moe
first, vLLM's own selection when it refuses), the method's create_weights (scales start NaN;
pack-quantized files get their int32 `weight_packed` / `weight_shape` tensors, which vLLM's W4A8
method cannot load) and process_weights_after_loading (pack, free, kernel)."""

import torch

from . import core, memory, patches

KIND = "W4A8 int4"


def group_size_of(weight_key):
    """vLLM's weight QuantKey -> -1 (channel-wise), the group size, or None (not int4 symmetric
    per output row)."""
    if weight_key is None or weight_key.dtype != torch.int8 or not weight_key.symmetric:
        return None
    shape = weight_key.scale.group_shape
    if tuple(shape) == (-1, 1):
        return -1
    if shape[0] == 1 and shape[1] > 0:
        return int(shape[1])
    return None


def _takes(config, weight_key, activation_key) -> bool:
    """Whether w4a8moe takes the layer (the log line says so, or why not)."""
    group = group_size_of(weight_key)
    if group is None or activation_key is not None:
        ok, reason = False, (f"quantization scheme {weight_key} x {activation_key}: w4a8moe "
                             f"takes int4 symmetric weights (channel-wise or grouped) with "
                             f"dynamic int8 activations")
    else:
        ok, reason = core.check(config, group)
    core.announce(KIND, config, ok, reason, ", not vLLM's CPU_INT4 backend")
    return ok


def _create_weights(method_module):
    def create_weights(self, layer, *args, **kwargs) -> None:
        # vLLM starts scales at 1 and loads the checkpoint's over them, expert by expert, so a
        # scale missing from the file would stay 1; NaN makes the packing see it.
        for name in ("w13_weight_scale", "w2_weight_scale"):
            getattr(layer, name).data.fill_(float("nan"))
        if _checkpoint_format(layer) == "pack-quantized":
            _create_packed_weights(layer, method_module, kwargs)  # advises its own words
        else:
            memory.huge_pages(layer)

    return create_weights


def install() -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a8_int8 as method_module,
    )

    module, method = method_module.__name__, "CompressedTensorsW4A8Int8MoEMethod"
    patches.replace(module, "select_w4a8_int8_moe_backend", __name__,
                    lambda vllm: core.wrap(vllm, core.selected, _takes))
    patches.replace(module, f"{method}.create_weights", __name__,
                    lambda vllm: core.wrap(vllm, _create_weights(method_module), core.is_ours,
                                           after=True))
    patches.replace(module, f"{method}.process_weights_after_loading", __name__,
                    lambda vllm: core.wrap(vllm, _pack_layer, core.is_ours))


def _checkpoint_format(layer) -> str:
    """The compressed-tensors format of the layer's experts ("int-quantized", or
    "pack-quantized": eight int4 values an int32 word)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config().quant_config
    name = f"{layer.layer_name}.0.{layer.ckpt_gate_proj_name}"
    scheme = config.get_scheme_dict(layer, name) or {}
    return scheme.get("format") or getattr(config, "quant_format", "") or ""


def _create_packed_weights(layer, method_module, weight_attrs) -> None:
    """vLLM's W4A8 method registers int8 `weight` tensors only (int-quantized); a
    pack-quantized file holds `weight_packed` int32 [N, K/8] (value k in bits 4 (k % 8) of
    word k/8, offset by 8) and `weight_shape`: these take their place (vLLM's own
    placeholders of those names are for its packed output) and _pack_layer unpacks them."""
    E, two_i, H = layer.w13_weight.shape
    I = layer.w2_weight.shape[2]
    attrs = dict(weight_attrs, is_transposed=False)
    nothing = torch.nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)
    method_module.replace_parameter(layer, "w13_weight", nothing)
    method_module.replace_parameter(layer, "w2_weight", nothing)
    for name, shape, dtype in (("w13_weight_packed", (E, two_i, H // 8), torch.int32),
                               ("w2_weight_packed", (E, H, I // 8), torch.int32),
                               ("w13_weight_shape", (E, 2), torch.float32),
                               ("w2_weight_shape", (E, 2), torch.float32)):
        if hasattr(layer, name):
            delattr(layer, name)
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype) if dtype == torch.float32
                                   else torch.empty(shape, dtype=dtype), requires_grad=False)
        layer.register_parameter(name, param)
        method_module.set_weight_attrs(param, attrs)
    memory.huge_pages(layer)  # before the words are first written
    layer.w13_weight_packed.data.zero_()
    layer.w2_weight_packed.data.zero_()
    layer.w4a8moe_packed_input = True


def check_weight_shapes(layer, rows13: int, hidden: int, inter: int, tp: int = 1) -> None:
    """compressed-tensors' weight_shape is each projection's [out, in] as the checkpoint holds
    it: gate's and up's land in one slot of w13's; under tensor parallelism it stays the whole
    projection's while the rank holds an I/tp slice (rows13 and inter are the rank's)."""
    prefix = getattr(layer, "layer_name", type(layer).__name__)
    for role, rows, cols in (("w13", rows13 * tp, hidden), ("w2", hidden, inter * tp)):
        shape = getattr(layer, f"{role}_weight_shape", None)
        if shape is None:
            continue
        shape = shape.data
        bad = (shape != torch.tensor([rows, cols], dtype=shape.dtype)).any(1)
        if bad.any():
            raise ValueError(
                f"{prefix}: {role} weight_shape of expert(s) {bad.nonzero().flatten().tolist()}: "
                f"expected [{rows}, {cols}] (a projection's [out, in]), got "
                f"{shape[bad][0].tolist()}")


def _pack_layer(method, layer) -> None:
    """What vLLM's W4A8 method does after loading, with w4a8moe's packing and experts."""
    import w4a8moe

    _, layout = core.ACTIVATIONS[core.activation_name(method.moe)]
    core.check_scales_loaded(layer, ("w13_weight_scale", "w2_weight_scale"))
    bias13 = core.bias_of(layer, "w13_bias") if method.has_bias else None
    bias2 = core.bias_of(layer, "w2_bias") if method.has_bias else None
    scale13, scale2 = layer.w13_weight_scale.data, layer.w2_weight_scale.data
    if getattr(layer, "w4a8moe_packed_input", False):
        E, two_i = layer.w13_weight_packed.shape[:2]
        H = layer.w2_weight_packed.shape[1]
        check_weight_shapes(layer, two_i // 2, H, layer.w2_weight_packed.shape[2] * 8,
                            method.moe.moe_parallel_config.tp_size)
        # compressed-tensors' weight_packed, decoded by the library (docs/checkpoints.md)
        w13_packed, w2_packed = w4a8moe.pack_checkpoint_moe(
            "compressed-tensors", layer.w13_weight_packed.data, scale13,
            layer.w2_weight_packed.data, scale2, method.group_size, w13_bias=bias13,
            w2_bias=bias2, gate_up_layout=layout)
    else:
        w13_packed, w2_packed = w4a8moe.pack(
            layer.w13_weight.data, layer.w2_weight.data, scale13, scale2, method.group_size,
            bias13, bias2, gate_up_layout=layout)
    for raw in ("w13_weight_shape", "w2_weight_shape"):
        if hasattr(layer, raw):
            delattr(layer, raw)
    free = ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"]
    if method.has_bias:  # packed with the weights; the layer keeps none
        free += ["w13_bias", "w2_bias"]
    core.install_layer(method, layer, w13_packed, w2_packed, method.group_size, free,
                       names=("w13_weight_packed", "w2_weight_packed"))
