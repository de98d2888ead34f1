"""vLLM's WNA16 MoE methods with int4 weights: compressed-tensors W4A16
(CompressedTensorsWNA16MoEMethod: pack-quantized, symmetric or with zero points, grouped or
channel-wise), GPTQ (AutoGPTQMoEMethod: sym or asym, checkpoint_format gptq or gptq_v2) and AWQ
(AutoAWQMoEMethod: gemm, zero points). vLLM's own CPU kernel for them needs AMX (and zentorch
takes only symmetric groups); w4a8moe runs them on every CPU.

This is a W4A8 computation of a W4A16 checkpoint: the weights are packed exactly as the file
holds them (int4 values, zero points, scales in float32), and the activations are quantized per
token to int8, as w4a8moe always does (vLLM does the same with VLLM_CPU_INT4_W4A8 on AMX).
docs/vllm.md gives the measured deviation; W4A8MOE_VLLM_FORMATS without "wna16" leaves these
layers to vLLM.

Wrapped in each method's module: select_wna16_moe_backend (w4a8moe first, with the method's
quantization config read for its scheme); the method's __init__ (compressed-tensors asserts that
a non-Marlin backend is grouped: channel-wise layers pass it as a group of the whole row),
create_weights (scales float32 and NaN, so they load exactly and a missing one is seen; the
zero points' loader records the experts it filled) and process_weights_after_loading.
"""

import torch

from . import core, patches

KIND = "W4A16 int4"
COMPUTES = (", as W4A8: the checkpoint's int4 weights exactly, the activations quantized per "
            "token to int8; not vLLM's WNA16 backends")


def scheme_of(quant_config):
    """vLLM's quantization config of the layer -> (dict(group, symmetric, fmt), None), or
    (None, the reason w4a8moe does not take it)."""
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    if isinstance(quant_config, QuantizationArgs):
        if quant_config.num_bits != 4 or str(getattr(quant_config.type, "value",
                                                     quant_config.type)) != "int":
            return None, f"{quant_config.num_bits}-bit {quant_config.type} weights (w4a8moe: int4)"
        strategy = str(getattr(quant_config.strategy, "value", quant_config.strategy))
        if strategy not in ("group", "channel"):
            return None, f"strategy {strategy} (w4a8moe: group or channel)"
        order = getattr(quant_config.actorder, "value", quant_config.actorder)
        if order == "group":
            return None, "run-time activation ordering (actorder: group)"
        group = -1 if strategy == "channel" or quant_config.group_size is None else int(
            quant_config.group_size)
        return dict(group=group, symmetric=bool(quant_config.symmetric),
                    fmt="compressed-tensors"), None
    if isinstance(quant_config, AutoGPTQConfig):
        if quant_config.weight_bits != 4:
            return None, f"{quant_config.weight_bits}-bit GPTQ (w4a8moe: 4-bit)"
        if quant_config.desc_act:
            return None, "GPTQ desc_act (run-time activation ordering)"
        # (GPTQModel's per-module `dynamic` rules: vLLM gives each MoE layer a copy of the config
        # with its rules applied, so the fields read here are the layer's own)
        fmt = quant_config.full_config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            return None, f"GPTQ checkpoint_format {fmt} (w4a8moe: gptq, gptq_v2)"
        return dict(group=int(quant_config.group_size), symmetric=bool(quant_config.is_sym),
                    fmt=fmt), None
    if isinstance(quant_config, AutoAWQConfig):
        if quant_config.weight_bits != 4:
            return None, f"{quant_config.weight_bits}-bit AWQ (w4a8moe: 4-bit)"
        if not quant_config.zero_point:
            return None, "AWQ without zero points"
        return dict(group=int(quant_config.group_size), symmetric=False, fmt="awq"), None
    return None, f"quantization config {type(quant_config).__name__}"


def _takes(config, weight_key, quant_config, *args, **kwargs) -> bool:
    """Whether w4a8moe takes the layer (select_wna16_moe_backend's arguments; the log line says
    so, or why not)."""
    scheme, reason = scheme_of(quant_config)
    ok = scheme is not None
    if ok:
        ok, reason = core.check(config, scheme["group"])
    core.announce(KIND, config, ok, reason, COMPUTES if ok else "")
    return ok


def _track_loads(layer, names):
    """Wraps the weight loader of each parameter named: it records (local expert, shard) per
    load in layer.w4a8moe_loaded[name], so that a tensor the file lacks for one expert is seen.
    (The loader is handed global expert ids; under expert parallelism those of other ranks map
    to -1 and load nothing here.)"""
    loaded = layer.__dict__.setdefault("w4a8moe_loaded", {})
    to_local = getattr(layer, "_map_global_expert_id_to_local_expert_id", lambda e: e)
    for name in names:
        param = getattr(layer, name)
        inner = param.weight_loader
        seen = loaded.setdefault(name, set())

        def loader(*args, _inner=inner, _seen=seen, **kwargs):
            result = _inner(*args, **kwargs)
            expert = kwargs.get("expert_id", args[4] if len(args) > 4 else None)
            shard = kwargs.get("shard_id", args[3] if len(args) > 3 else None)
            if expert is not None and to_local(int(expert)) >= 0:
                _seen.add((to_local(int(expert)), shard))
            return result

        param.weight_loader = loader


def _check_loads(layer, names, experts):
    prefix = getattr(layer, "layer_name", type(layer).__name__)
    for name in names:
        seen = layer.w4a8moe_loaded.get(name, set())
        shards = ("w1", "w3") if name.startswith("w13") else ("w2",)
        missing = sorted({e for e in range(experts) for s in shards if (e, s) not in seen})
        if missing:
            raise ValueError(f"{prefix}: {name} of expert(s) {missing} not loaded: the "
                             f"checkpoint lacks their {'gate/up' if name[1] == '1' else 'down'} "
                             f"projection's {name.split('_', 1)[1]}")


# per method class: (scale names, zero-point names)
_PARAMS = {
    "CompressedTensorsWNA16MoEMethod": (("w13_weight_scale", "w2_weight_scale"),
                                        ("w13_weight_zero_point", "w2_weight_zero_point")),
    "AutoGPTQMoEMethod": (("w13_scales", "w2_scales"), ("w13_qzeros", "w2_qzeros")),
    "AutoAWQMoEMethod": (("w13_scales", "w2_scales"), ("w13_qzeros", "w2_qzeros")),
}


def _quant_config_of(method):
    return getattr(method, "weight_quant", None) or method.quant_config


def _init(vllm_init, method_cls):
    def __init__(self, *args, **kwargs):
        quant = kwargs.get("weight_quant", args[0] if args else None)
        channel = (method_cls.__name__ == "CompressedTensorsWNA16MoEMethod"
                   and str(getattr(quant.strategy, "value", quant.strategy)) == "channel")
        if not channel:
            vllm_init(self, *args, **kwargs)
        else:  # a group of the whole row for vLLM's assert; its true strategy put back after
            grouped = quant.model_copy(update={"strategy": "group", "group_size": None})
            rest = dict(kwargs)
            rest.pop("weight_quant", None)
            vllm_init(self, grouped, *args[1:], **rest)
            if not core.is_ours(self):
                vllm_init(self, *args, **kwargs)  # vLLM's own choice, as without the plugin
                return
            self.weight_quant, self.strategy, self.group_size = quant, quant.strategy, -1
        if core.is_ours(self):
            self.w4a8moe_scheme = scheme_of(_quant_config_of(self))[0]

    return __init__


def _patch(method_module, method_cls) -> None:
    scales, zeros = _PARAMS[method_cls.__name__]

    def create_weights(self, layer, *args, **kwargs) -> None:
        core.exact_scales(layer, scales)
        if not self.w4a8moe_scheme["symmetric"]:
            _track_loads(layer, zeros)

    def process_weights_after_loading(self, layer) -> None:
        _pack_layer(self, layer, scales, zeros)

    module, name = method_module.__name__, method_cls.__name__
    patches.replace(module, "select_wna16_moe_backend", __name__,
                    lambda vllm: core.wrap(vllm, core.selected, _takes))
    patches.replace(module, f"{name}.__init__", __name__,
                    lambda vllm: _init(vllm, method_cls))
    patches.replace(module, f"{name}.create_weights", __name__,
                    lambda vllm: core.wrap(vllm, create_weights, core.is_ours, after=True))
    patches.replace(module, f"{name}.process_weights_after_loading", __name__,
                    lambda vllm: core.wrap(vllm, process_weights_after_loading, core.is_ours))


def install() -> None:
    from vllm.model_executor.layers.quantization import auto_awq, auto_gptq
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct,
    )

    _patch(ct, ct.CompressedTensorsWNA16MoEMethod)
    _patch(auto_gptq, auto_gptq.AutoGPTQMoEMethod)
    _patch(auto_awq, auto_awq.AutoAWQMoEMethod)


def _pack_layer(method, layer, scales, zeros) -> None:
    from w4a8moe.checkpoint import pack_checkpoint_moe
    from w4a8moe.vllm import pack_awq_moe, pack_gptq_moe

    from .w4a8 import check_weight_shapes

    scheme = method.w4a8moe_scheme
    group, symmetric, fmt = scheme["group"], scheme["symmetric"], scheme["fmt"]
    core.check_scales_loaded(layer, scales)
    experts = getattr(layer, scales[0]).shape[0]
    if not symmetric:
        _check_loads(layer, zeros, experts)
    _, layout = core.ACTIVATIONS[core.activation_name(method.moe)]
    loaded_only = fmt != "compressed-tensors"  # GPTQ/AWQ register zero biases of their own
    bias13 = core.bias_of(layer, "w13_bias", loaded_only)
    bias2 = core.bias_of(layer, "w2_bias", loaded_only)
    s13, s2 = (getattr(layer, n).data for n in scales)
    if fmt == "compressed-tensors":
        # weight_packed [E, N, K/8], scales [E, N, G], zero points [E, N/8, G] (docs/
        # checkpoints.md), decoded by the library
        w13q, w2q = layer.w13_weight_packed.data, layer.w2_weight_packed.data
        check_weight_shapes(layer, w13q.shape[1] // 2, 8 * w13q.shape[2], 8 * w2q.shape[2],
                            method.moe.moe_parallel_config.tp_size)
        w13_packed, w2_packed = pack_checkpoint_moe(
            "compressed-tensors", w13q, s13, w2q, s2, group,
            w13_zero_point=None if symmetric else layer.w13_weight_zero_point.data,
            w2_zero_point=None if symmetric else layer.w2_weight_zero_point.data,
            w13_bias=None if bias13 is None else bias13.float(),
            w2_bias=None if bias2 is None else bias2.float(), gate_up_layout=layout)
        free = ["w13_weight_packed", "w2_weight_packed", "w13_weight_shape", "w2_weight_shape"]
    elif fmt in ("gptq", "gptq_v2"):
        w13_packed, w2_packed = pack_gptq_moe(
            layer.w13_qweight.data, layer.w2_qweight.data, s13, s2, group,
            w13_qzeros=layer.w13_qzeros.data, w2_qzeros=layer.w2_qzeros.data, sym=symmetric,
            zeros_minus_one=fmt == "gptq", w13_bias=bias13, w2_bias=bias2,
            gate_up_layout=layout)
        free = ["w13_qweight", "w2_qweight"]
    else:
        w13_packed, w2_packed = pack_awq_moe(
            layer.w13_qweight.data, layer.w2_qweight.data, s13, s2, layer.w13_qzeros.data,
            layer.w2_qzeros.data, group, w13_bias=bias13, w2_bias=bias2, gate_up_layout=layout)
        free = ["w13_qweight", "w2_qweight"]
    free += list(scales) + list(zeros) + ["w13_bias", "w2_bias"]
    core.install_layer(method, layer, w13_packed, w2_packed, group, free)
