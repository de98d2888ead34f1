"""vLLM plugin: the engine's W4A8 int4 MoE layers run through w4a8moe on every CPU.

Installed with the package, it is a `vllm.general_plugins` entry point (pyproject.toml), which
vLLM loads in each of its processes (front end, engine core, workers) before it builds a model.
It changes none of vLLM's files. On vLLM's CPU platform it hooks in where vLLM chooses the
experts kernel of a compressed-tensors W4A8 int4 MoE layer (int4 weights, channel-wise or
grouped, with dynamic per-token int8 activations: CompressedTensorsW4A8Int8MoEMethod):

  * selection: the layer's configuration (shapes, group size, activation, dtype, routing,
    parallelism) is offered to w4a8moe first; when w4a8moe takes it, vLLM's log says so
    ("w4a8moe: W4A8 int4 MoE ... runs through w4a8moe"), and when w4a8moe refuses, the log
    gives the reason and vLLM's own selection runs as it would without the plugin (on x86 that
    selection refuses the layer; on Arm it picks its KleidiAI kernel);
  * weight loading: process_weights_after_loading packs the layer's int4 weights, scales and
    biases once with w4a8moe.pack (scales as vLLM holds them: bfloat16 grouped, float32
    channel-wise), and frees the unpacked tensors as vLLM does;
  * forward: vLLM's CPU router picks the experts from the router logits (as vLLM's CPU int4
    experts do, with the layer's custom routing function when it has one: Llama 4's sigmoid
    top-1), then torch.ops.w4a8moe.dynamic_4bit_int_moe_ex runs the layer, with vLLM's
    activation (silu, swigluoai with its alpha and limit, gelu, gelu_tanh, swiglustep),
    apply_router_weight_on_input and the model's biases.

Settings (environment variables, read in each vLLM process):
  W4A8MOE_VLLM        "auto" (default): as above; "off": the plugin does nothing.
  W4A8MOE_VLLM_TRACE  a file path: each process appends one line per layer packed
                      ("pack <H> <I> <E> <group> <activation> <kernel set>") and per forward
                      call ("forward <tokens> <1 if the router weight is on the input>"), so that a test or a user can see that w4a8moe
                      ran; off when unset (no cost).

Supported vLLM versions: SUPPORTED_VLLM below (also the `vllm` extra of the package). Another
version is refused when the plugin loads, with the versions it supports, because the plugin
relies on the names of vLLM's internal modules; W4A8MOE_VLLM=off lets that vLLM run without it.
docs/vllm.md tells a vLLM user how to install and serve.
"""

import enum
import os
import threading
from typing import Optional, Tuple

import torch

#: vLLM releases the plugin was tested with, as a half-open range [low, high).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

_installed = False
_install_lock = threading.Lock()

# vLLM's MoEActivation value -> (w4a8moe activation, gate/up layout of vLLM's w13 rows)
_ACTIVATIONS = {
    "silu": ("silu", "halves"),
    "gelu": ("gelu", "halves"),
    "gelu_tanh": ("gelu_tanh", "halves"),
    "swiglustep": ("swiglustep", "halves"),
    "swigluoai": ("swigluoai", "interleaved"),  # gpt-oss: gate j in row 2j, up j in 2j + 1
    "swigluoai_uninterleave": ("swigluoai", "halves"),
}


def _version_tuple(text: str) -> Tuple[int, ...]:
    digits = []
    for part in text.split("+")[0].split("."):
        number = "".join(c for c in part if c.isdigit())
        if not number:
            break
        digits.append(int(number))
        if len(digits) == 3:
            break
    return tuple(digits)


def check_vllm_version(version: str) -> None:
    """Raises RuntimeError, naming both, when `version` is outside SUPPORTED_VLLM."""
    low, high = SUPPORTED_VLLM
    if not (_version_tuple(low) <= _version_tuple(version) < _version_tuple(high)):
        raise RuntimeError(
            f"w4a8moe's vLLM plugin: vLLM {version} is not supported (expected >= {low}, < {high}"
            f"; install a supported vLLM as docs/vllm.md says, or set W4A8MOE_VLLM=off to run "
            f"this vLLM without the plugin)")


def _trace(line: str) -> None:
    path = os.environ.get("W4A8MOE_VLLM_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {line}\n")


def register() -> None:
    """The entry point vLLM calls in each process (vllm.general_plugins)."""
    mode = os.environ.get("W4A8MOE_VLLM", "auto").lower()
    if mode == "off":
        return
    if mode != "auto":
        raise ValueError(f"W4A8MOE_VLLM: expected 'auto' or 'off', got '{mode}'")
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _vllm_logger().debug("w4a8moe: not vLLM's CPU platform; the plugin stays inactive")
        return
    _install()


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        _patch_compressed_tensors_w4a8()
        _installed = True


def _experts_class():
    """The experts kernel class, made on first use (it derives from vLLM's classes)."""
    global _EXPERTS
    if _EXPERTS is None:
        _EXPERTS = _make_experts_class()
    return _EXPERTS


_EXPERTS = None


class W4A8MoeBackend(enum.Enum):
    """The backend value the W4A8 method records when w4a8moe runs its layer."""

    W4A8MOE = "W4A8MOE"


def _group_size_of(weight_key) -> Optional[int]:
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


def _make_experts_class():
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm import envs
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe import CPUExpertsInt4
    from vllm.platforms import current_platform

    import w4a8moe

    class W4A8MoeExperts(CPUExpertsInt4):
        """vLLM's CPU int4 W4A8 experts contract (monolithic: router logits in), run by
        w4a8moe on any CPU w4a8moe.is_supported_config accepts."""

        # The layer's custom_routing_function (Llama 4: sigmoid of the top-1 logit), set on a
        # subclass per layer by _pack_layer: the monolithic call does not pass it, and
        # FusedMoEConfig.routing_method says Default for such layers.
        routing_function = None

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            if not current_platform.is_cpu():
                return False, "vLLM's platform is not the CPU"
            activation = getattr(moe_config.activation, "value", str(moe_config.activation))
            if activation not in _ACTIVATIONS:
                return False, (f"activation {activation}: w4a8moe runs "
                               f"{', '.join(sorted(_ACTIVATIONS))}")
            group = _group_size_of(weight_key)
            if group is None or activation_key is not None:
                return False, (f"quantization scheme {weight_key} x {activation_key}: w4a8moe "
                               f"takes int4 symmetric weights (channel-wise or grouped) with "
                               f"dynamic int8 activations")
            beta = getattr(moe_config, "swiglu_beta", None)
            if beta is not None and beta != 1.0:
                return False, f"swiglu_beta {beta}: w4a8moe's swigluoai adds 1 to up"
            if moe_config.in_dtype not in (torch.float32, torch.bfloat16, torch.float16):
                return False, f"dtype {moe_config.in_dtype}"
            if envs.VLLM_BATCH_INVARIANT:
                return False, "VLLM_BATCH_INVARIANT is set (not promised by w4a8moe)"
            ok, reason = mk.FusedMoEExperts.is_supported_config(
                cls, moe_config, weight_key, activation_key, activation_format)
            if not ok:
                return False, reason
            ok, reason = w4a8moe.is_supported_config(
                moe_config.hidden_dim, moe_config.intermediate_size_per_partition,
                moe_config.num_local_experts, moe_config.experts_per_token, group,
                _ACTIVATIONS[activation][0], moe_config.in_dtype)
            return ok, reason

        @staticmethod
        def _supports_activation(activation) -> bool:
            return getattr(activation, "value", activation) in _ACTIVATIONS

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return _group_size_of(weight_key) is not None and activation_key is None

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            # Tensor parallelism splits I (vLLM reduces the outputs); expert parallelism over
            # vLLM's expert map is not wired (w4a8moe.distributed has its own).
            return moe_parallel_config.ep_size == 1

        @staticmethod
        def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
            return routing_method in (RoutingMethodType.Default, RoutingMethodType.Renormalize,
                                      RoutingMethodType.RenormalizeNaive)

        def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts,
                  expert_map, a1q_scale, apply_router_weight_on_input, num_expert_group=None,
                  e_score_correction_bias=None, routed_scaling_factor=None, topk_group=None,
                  routing_replay_out=None):
            from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

            config = self.moe_config
            topk_weights, topk_ids = select_experts(
                custom_routing_function=type(self).routing_function,
                hidden_states=hidden_states,
                router_logits=router_logits,
                use_grouped_topk=num_expert_group is not None,
                top_k=config.experts_per_token,
                renormalize=config.routing_method in (RoutingMethodType.Renormalize,
                                                      RoutingMethodType.RenormalizeNaive),
                topk_group=topk_group,
                num_expert_group=num_expert_group,
                scoring_func="softmax",
                routed_scaling_factor=(1.0 if routed_scaling_factor is None
                                       else routed_scaling_factor),
                e_score_correction_bias=e_score_correction_bias,
            )
            name = getattr(activation, "value", activation)
            alpha = config.swiglu_alpha if config.swiglu_alpha is not None else 1.702
            limit = config.swiglu_limit if config.swiglu_limit is not None else 7.0
            _trace(f"forward {hidden_states.shape[0]} {int(bool(apply_router_weight_on_input))}")
            block = self.quant_config.block_shape  # [-1, 1] channel-wise, [1, g] grouped
            group = -1 if list(block) == [-1, 1] else int(block[1])
            return w4a8moe.ops.dynamic_4bit_int_moe_ex(
                hidden_states, topk_ids, topk_weights, w1, w2, config.hidden_dim,
                config.intermediate_size_per_partition, group, bool(apply_router_weight_on_input),
                w4a8moe.activation_code(_ACTIVATIONS[name][0]), float(alpha), float(limit))

    return W4A8MoeExperts


def _patch_compressed_tensors_w4a8() -> None:
    """Wraps the W4A8 int4 MoE method's kernel selection and weight processing (module
    attributes of vLLM's compressed_tensors_moe_w4a8_int8)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a8_int8 as method_module,
    )

    vllm_select = method_module.select_w4a8_int8_moe_backend
    method_cls = method_module.CompressedTensorsW4A8Int8MoEMethod
    vllm_process = method_cls.process_weights_after_loading
    logger = _vllm_logger()
    said = set()

    def select_w4a8_int8_moe_backend(config, weight_key, activation_key):
        experts = _experts_class()
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk

        ok, reason = experts.is_supported_config(experts, config, weight_key, activation_key,
                                                 mk.FusedMoEActivationFormat.Standard)
        what = (f"H {config.hidden_dim}, I {config.intermediate_size_per_partition}, "
                f"{config.num_local_experts} experts, top-{config.experts_per_token}, "
                f"weights {weight_key}, activation "
                f"{getattr(config.activation, 'value', config.activation)}")
        if ok:
            import w4a8moe

            message = (f"w4a8moe: W4A8 int4 MoE ({what}) runs through w4a8moe (kernel set "
                       f"{w4a8moe.active_kernel_set()}), not vLLM's CPU_INT4 backend")
            if message not in said:
                said.add(message)
                logger.info(message)
            return W4A8MoeBackend.W4A8MOE, experts
        message = (f"w4a8moe: W4A8 int4 MoE ({what}) is refused by w4a8moe ({reason}); "
                   f"vLLM selects its own backend")
        if message not in said:
            said.add(message)
            logger.warning(message)
        return vllm_select(config, weight_key, activation_key)

    def create_weights(self, layer, *args, **kwargs) -> None:
        vllm_create(self, layer, *args, **kwargs)
        if self.experts_cls is _experts_class():
            # vLLM starts scales at 1 and loads the checkpoint's over them, expert by expert,
            # so a scale missing from the file would stay 1; NaN makes _pack_layer see it.
            for name in ("w13_weight_scale", "w2_weight_scale"):
                getattr(layer, name).data.fill_(float("nan"))
            if _checkpoint_format(layer) == "pack-quantized":
                _create_packed_weights(layer, method_module, kwargs)

    def process_weights_after_loading(self, layer) -> None:
        if self.experts_cls is not _experts_class():
            return vllm_process(self, layer)
        _pack_layer(self, layer, method_module)

    vllm_create = method_cls.create_weights
    method_module.select_w4a8_int8_moe_backend = select_w4a8_int8_moe_backend
    method_cls.create_weights = create_weights
    method_cls.process_weights_after_loading = process_weights_after_loading


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
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        layer.register_parameter(name, param)
        method_module.set_weight_attrs(param, attrs)
    layer.w4a8moe_packed_input = True


def _pack_layer(method, layer, method_module) -> None:
    """What vLLM's W4A8 method does after loading, with w4a8moe's packing and experts."""
    import w4a8moe
    from w4a8moe.vllm import _unpack_cols

    prefix = getattr(layer, "layer_name", type(layer).__name__)
    if getattr(layer, "w4a8moe_packed_input", False):
        E, two_i = layer.w13_weight_packed.shape[:2]
        H = layer.w2_weight_packed.shape[1]
        # weight_shape is each projection's [out, in]: gate's and up's land in one slot
        for role, rows, cols in (("w13", two_i // 2, H),
                                 ("w2", H, layer.w2_weight_packed.shape[2] * 8)):
            shape = getattr(layer, f"{role}_weight_shape").data
            bad = (shape != torch.tensor([rows, cols], dtype=shape.dtype)).any(1)
            if bad.any():
                raise ValueError(
                    f"{prefix}: {role} weight_shape of expert(s) "
                    f"{bad.nonzero().flatten().tolist()}: expected [{rows}, {cols}] (a "
                    f"projection's [out, in]), got {shape[bad][0].tolist()}")
        # compressed-tensors packs along the inputs, low nibble first, values offset by 8
        w13 = (_unpack_cols(layer.w13_weight_packed.data, awq=False) - 8).to(torch.int8)
        w2 = (_unpack_cols(layer.w2_weight_packed.data, awq=False) - 8).to(torch.int8)
    else:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data

    name = getattr(method.moe.activation, "value", method.moe.activation)
    _, layout = _ACTIVATIONS[name]
    for role in ("w13", "w2"):
        scale = getattr(layer, f"{role}_weight_scale").data
        missing = torch.isnan(scale.float()).flatten(1).any(1).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"{prefix}: {role}_weight_scale of expert(s) {missing} not loaded: the "
                f"checkpoint lacks their gate/up or down projection's weight_scale")
    bias13 = layer.w13_bias if method.has_bias else None
    bias2 = layer.w2_bias if method.has_bias else None
    w13_packed, w2_packed = w4a8moe.pack(
        w13, w2, layer.w13_weight_scale.data,
        layer.w2_weight_scale.data, method.group_size,
        None if bias13 is None else bias13.data.float(),
        None if bias2 is None else bias2.data.float(),
        gate_up_layout=layout)
    replace = method_module.replace_parameter
    nothing = torch.empty(0)
    replace(layer, "w13_weight_packed", torch.nn.Parameter(w13_packed, requires_grad=False))
    replace(layer, "w2_weight_packed", torch.nn.Parameter(w2_packed, requires_grad=False))
    for raw in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        replace(layer, raw, torch.nn.Parameter(nothing, requires_grad=False))
    for raw in ("w13_weight_shape", "w2_weight_shape"):
        if hasattr(layer, raw):
            delattr(layer, raw)
    if method.has_bias:  # packed with the weights; the layer keeps none
        for raw in ("w13_bias", "w2_bias"):
            replace(layer, raw, torch.nn.Parameter(nothing, requires_grad=False))
    info = w4a8moe.packed_info(w13_packed)
    _trace(f"pack {info.cols} {info.rows // 2} {info.experts} {info.group_size} {name} "
           f"{w4a8moe.active_kernel_set()}")
    experts_cls = method.experts_cls
    routing = getattr(layer, "custom_routing_function", None)
    if routing is not None:
        experts_cls = type(experts_cls.__name__, (experts_cls,),
                           {"routing_function": staticmethod(routing)})
    quant_config = method.get_fused_moe_quant_config(layer)
    method.moe_kernel = method_module.make_w4a8_int8_moe_kernel(
        moe_quant_config=quant_config, moe_config=method.moe, experts_cls=experts_cls,
        routing_tables=layer._expert_routing_tables())


def _vllm_logger():
    from vllm.logger import init_logger

    # under "vllm.", so vLLM's logging configuration (format, VLLM_LOGGING_LEVEL) applies
    return init_logger("vllm.w4a8moe_plugin")
