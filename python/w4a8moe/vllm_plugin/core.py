"""What every method family of the plugin shares: the settings, the trace, vLLM's logger, the
experts class (vLLM's monolithic experts contract run by w4a8moe's op), the checks every
layer passes before w4a8moe takes it, the log lines, and the step that installs a packed layer
(free vLLM's tensors, make the layer's experts and vLLM's kernel around them).

The family modules (w4a8, wna16, mxfp4) hook vLLM's selection and weight processing for their
methods and call into this module; docs/vllm.md describes what each takes. Every hook has the
same form, wrap(): vLLM's own function unless the call is w4a8moe's; patches.py lists them.
"""

import enum
import functools
import os
from typing import Iterable, NamedTuple, Optional, Tuple

import torch

from .._activations import NAMES as ACTIVATION_NAMES

#: vLLM releases the plugin was tested with, as a half-open range [low, high).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

#: The method families, as W4A8MOE_VLLM_FORMATS names them.
FAMILIES = ("w4a8", "wna16", "mxfp4")

#: vLLM's MoEActivation value -> (w4a8moe activation, gate/up layout of vLLM's w13 rows): each of
#: w4a8moe's activations under its own name with gate and up in halves, but vLLM's swigluoai
#: (gpt-oss: gate j in row 2j, up j in 2j + 1), whose halves form vLLM calls
#: swigluoai_uninterleave.
ACTIVATIONS = {name: (name, "halves") for name in ACTIVATION_NAMES}
ACTIVATIONS["swigluoai"] = ("swigluoai", "interleaved")
ACTIVATIONS["swigluoai_uninterleave"] = ("swigluoai", "halves")


class Backend(enum.Enum):
    """The backend value a vLLM method records when w4a8moe runs its layer."""

    W4A8MOE = "W4A8MOE"


def wrap(vllm_function, ours, when, after=False):
    """What the plugin puts in place of one of vLLM's functions or methods (through
    patches.replace): vLLM's own call, unless when(*args, **kwargs) says the call is w4a8moe's
    (a layer or configuration w4a8moe takes); then ours(*args, **kwargs) runs in place of
    vLLM's, or with after=True after it (when is then asked after vLLM's call, which may make
    the choice it reads; vLLM's result is returned)."""

    @functools.wraps(vllm_function)
    def wrapper(*args, **kwargs):
        if after:
            result = vllm_function(*args, **kwargs)
            if when(*args, **kwargs):
                ours(*args, **kwargs)
            return result
        if when(*args, **kwargs):
            return ours(*args, **kwargs)
        return vllm_function(*args, **kwargs)

    return wrapper


def is_ours(method, *args, **kwargs) -> bool:
    """Whether vLLM's MoE method `method` runs its layer through w4a8moe (its selection chose
    the experts class); the rest of a method call's arguments are ignored."""
    return method.experts_cls is experts_class()


def selected(*args, **kwargs):
    """The selection's answer for a layer w4a8moe takes: its backend and experts class."""
    return Backend.W4A8MOE, experts_class()


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


def families() -> Tuple[str, ...]:
    """The families W4A8MOE_VLLM_FORMATS asks for ("all", the default, or a comma list)."""
    text = os.environ.get("W4A8MOE_VLLM_FORMATS", "all").strip().lower()
    if text == "all":
        return FAMILIES
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise ValueError(f"W4A8MOE_VLLM_FORMATS: expected 'all' or a comma list of "
                         f"{', '.join(FAMILIES)}, got '{text}'")
    return names


def tracing() -> bool:
    return not torch.compiler.is_compiling() and bool(os.environ.get("W4A8MOE_VLLM_TRACE"))


def trace(line: str) -> None:
    """Appends the line to W4A8MOE_VLLM_TRACE; not from a graph torch.compile is capturing (no
    file I/O there: the compiled graph would not repeat it anyway)."""
    if torch.compiler.is_compiling():
        return
    path = os.environ.get("W4A8MOE_VLLM_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {line}\n")


def logger():
    from vllm.logger import init_logger

    # under "vllm.", so vLLM's logging configuration (format, VLLM_LOGGING_LEVEL) applies
    return init_logger("vllm.w4a8moe_plugin")


_said = set()


def say(message: str, warning: bool = False) -> None:
    """Logs a message once per process."""
    if message in _said:
        return
    _said.add(message)
    (logger().warning if warning else logger().info)(message)


def activation_name(config) -> str:
    return getattr(config.activation, "value", str(config.activation))


def describe(config) -> str:
    return (f"H {config.hidden_dim}, I {config.intermediate_size_per_partition}, "
            f"{config.num_local_experts} experts, top-{config.experts_per_token}, activation "
            f"{activation_name(config)}")


def announce(kind: str, config, ok: bool, reason: Optional[str], computes: str = "",
             theirs: str = "vLLM selects its own backend") -> None:
    """The log line of a selection: taken (with what w4a8moe computes) or refused (why)."""
    import w4a8moe

    if ok:
        say(f"w4a8moe: {kind} MoE ({describe(config)}) runs through w4a8moe (kernel set "
            f"{w4a8moe.active_kernel_set()}){computes}")
    else:
        say(f"w4a8moe: {kind} MoE ({describe(config)}) is refused by w4a8moe ({reason}); "
            f"{theirs}", warning=True)


_EXPERTS = None


def experts_class():
    """The experts kernel class, made on first use (it derives from vLLM's classes)."""
    global _EXPERTS
    if _EXPERTS is None:
        _EXPERTS = _make_experts_class()
    return _EXPERTS


def check(config, group: int, weight_format: str = "int4") -> Tuple[bool, Optional[str]]:
    """The checks every family's layer passes: platform, activation, dtype, vLLM's experts
    contract (parallelism, routing, LoRA, hash routing) and w4a8moe.is_supported_config."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm import envs
    from vllm.platforms import current_platform

    import w4a8moe

    if not current_platform.is_cpu():
        return False, "vLLM's platform is not the CPU"
    activation = activation_name(config)
    if activation not in ACTIVATIONS:
        return False, f"activation {activation}: w4a8moe runs {', '.join(sorted(ACTIVATIONS))}"
    beta = getattr(config, "swiglu_beta", None)
    if beta is not None and beta != 1.0:
        return False, f"swiglu_beta {beta}: w4a8moe's swigluoai adds 1 to up"
    if config.in_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"dtype {config.in_dtype}"
    if envs.VLLM_BATCH_INVARIANT:
        return False, "VLLM_BATCH_INVARIANT is set (not promised by w4a8moe)"
    ok, reason = parallel_check(config.moe_parallel_config)
    if not ok:
        return False, reason
    ok, reason = routing_check(config.routing_method)
    if not ok:
        return False, reason
    cls = experts_class()
    ok, reason = mk.FusedMoEExperts.is_supported_config(
        cls, config, None, None, mk.FusedMoEActivationFormat.Standard)
    if not ok:
        return False, reason
    return w4a8moe.is_supported_config(
        config.hidden_dim, config.intermediate_size_per_partition, config.num_local_experts,
        config.experts_per_token, group, ACTIVATIONS[activation][0], config.in_dtype)


def parallel_check(parallel) -> Tuple[bool, Optional[str]]:
    """vLLM's parallelism of a MoE layer. Tensor parallelism: each rank holds an I/tp slice of
    every expert and vLLM all-reduces the outputs. Expert parallelism within tensor parallelism
    (--enable-expert-parallel, data parallelism 1): each rank holds its E/ep experts whole, every
    rank sees every token, and the experts class computes the rank's own experts' share of each
    (w4a8moe's forward_local over vLLM's expert map), which vLLM's all-reduce adds up."""
    if parallel.ep_size == 1:
        return True, None
    if parallel.use_all2all_kernels:
        return False, (f"expert parallelism with data parallelism {parallel.dp_size} (vLLM's "
                       f"all-to-all dispatch, backend {parallel.all2all_backend}): w4a8moe takes "
                       f"expert parallelism within tensor parallelism (data parallelism 1)")
    if parallel.enable_eplb:
        return False, ("expert load balancing (--enable-eplb: redundant, moving experts): "
                       "w4a8moe packs each rank's experts once")
    return True, None


#: vLLM's routing methods (FusedMoEConfig.routing_method) w4a8moe's experts take: those vLLM's
#: CPU router reports for the softmax and sigmoid layers it routes. The layer's own Routing and
#: the experts call's arguments then say how (op_routing); what w4a8moe's op does not express
#: (custom routing functions, expert parallelism) goes to vLLM's CPU router (select_experts),
#: as routing_plan() logs.
ROUTING_METHODS = (
    "Default",           # softmax, top-k (Qwen2-MoE, OLMoE, DeepSeek-V2 without renormalising)
    "Renormalize",       # softmax of the top-k logits
    "RenormalizeNaive",  # softmax, top-k, renormalised (Mixtral, Qwen3-MoE, Qwen3-Next)
    "DeepSeekV3",        # sigmoid + correction bias, grouped top-k (DeepSeek-V3, Kimi K2, GLM-4.5)
    "MiniMax2",          # sigmoid + correction bias, ungrouped, renormalised (MiniMax-M2)
    "Sigmoid",           # sigmoid, top-k
    "SigmoidRenorm",     # sigmoid, top-k, renormalised
)


def routing_check(method) -> Tuple[bool, Optional[str]]:
    """Whether w4a8moe's experts take a layer of vLLM's routing method `method`, with the reason
    when not. vLLM's MoE kernels with the router inside (w4a8moe's is one: vLLM calls it with
    the router logits) never run the layer's router object; vLLM marks the routers whose work
    that would skip with methods such kernels refuse."""
    from vllm import envs

    name = getattr(method, "name", str(method))
    if getattr(envs, "VLLM_MOE_ROUTING_SIMULATION_STRATEGY", ""):
        return False, ("VLLM_MOE_ROUTING_SIMULATION_STRATEGY is set: vLLM's simulated router "
                       "chooses the experts, and experts with the router inside never call it")
    if name in ROUTING_METHODS:
        return True, None
    if name == "DeepseekV4":
        return False, ("routing method DeepseekV4: sqrtsoftplus scores, which w4a8moe's op does "
                       "not compute")
    if name == "Unspecified":
        return False, ("routing method Unspecified: vLLM's zero-expert router (LongCat-Flash) "
                       "reports it so that experts with the router inside refuse its layers "
                       "(the router computes the zero experts' share itself); its CPU router "
                       "reports it for a correction bias with softmax scores or without "
                       "renormalisation, which cannot be told apart from it here")
    return False, (f"routing method {name}: not one vLLM's CPU router reports (w4a8moe takes "
                   f"{', '.join(ROUTING_METHODS)})")


class Routing(NamedTuple):
    """A layer's routing as vLLM's MoE layer holds it (its scoring_func, renormalize and
    use_grouped_topk); the experts call receives the rest (groups, correction bias, scaling)."""

    scoring_func: str
    renormalize: bool
    grouped: bool


def routing_of(layer) -> Optional[Routing]:
    """The layer's Routing, or None when the layer does not say (then the experts class derives
    it from the FusedMoEConfig as before: softmax, renormalize from the routing method)."""
    if not all(hasattr(layer, a) for a in ("scoring_func", "renormalize", "use_grouped_topk")):
        return None
    return Routing(str(layer.scoring_func), bool(layer.renormalize), bool(layer.use_grouped_topk))


def op_routing(routing: Routing, num_expert_group, topk_group, e_score_correction_bias,
               routed_scaling_factor: float):
    """The routing arguments of w4a8moe's moe_routed for a layer (scoring_func, renormalize,
    routed_scaling_factor, num_expert_group, topk_group, e_score_correction_bias), or None where
    the op does not express it (another scoring function, grouping without its sizes). The
    caller has already sent custom routing functions and expert parallelism elsewhere.

    Grouped (use_grouped_topk): vLLM's CPU router's grouped top-k, with every argument.
    Ungrouped softmax without a correction bias: its plain top-k, which applies no scaling
    factor (nor does vLLM's FusedTopKRouter elsewhere). Ungrouped layers with a correction bias
    or sigmoid scores, which vLLM's CPU router does not route (it drops the bias, refuses
    sigmoid): as vLLM's FusedTopKBiasRouter and FusedTopKRouter compute them (the bias for the
    choice, the scaling factor with the bias only)."""
    if routing.scoring_func not in ("softmax", "sigmoid"):
        return None
    bias = e_score_correction_bias
    if routing.grouped:
        if num_expert_group is None or topk_group is None:
            return None
        return (routing.scoring_func, routing.renormalize, float(routed_scaling_factor),
                int(num_expert_group), int(topk_group), bias)
    scaling = float(routed_scaling_factor) if bias is not None else 1.0
    return (routing.scoring_func, routing.renormalize, scaling, 1, 1, bias)


def routing_plan(routing: Routing, layer, custom: bool, expert_parallel: bool) -> str:
    """The log line saying how a packed layer's routing runs: inside w4a8moe's op, or chosen by
    vLLM's CPU router (select_experts, with the reason) and the experts run by w4a8moe."""
    bias = getattr(layer, "e_score_correction_bias", None)
    groups, topk_group = (getattr(layer, n, None) for n in ("num_expert_group", "topk_group"))
    scaling = getattr(layer, "routed_scaling_factor", None)
    scaling = 1.0 if scaling is None else float(scaling)
    fused = op_routing(routing, groups, topk_group, bias, scaling)
    text = routing.scoring_func + (" + correction bias" if bias is not None else "")
    if routing.grouped:
        text += f", the best {topk_group} of {groups} groups"
    text += ", renormalised" if routing.renormalize else ""
    if fused is not None and not custom and not expert_parallel:
        text += f", scaled by {fused[2]:g}" if fused[2] != 1.0 else ""
        how = ("as vLLM's CPU router computes it" if routing.grouped or (
            routing.scoring_func == "softmax" and bias is None) else
            "as vLLM's FusedTopKRouter / FusedTopKBiasRouter compute it (its CPU router lacks "
            "ungrouped sigmoid scores and correction biases)")
        return f"w4a8moe: MoE routing ({text}) inside w4a8moe's op (moe_routed), {how}"
    text += f", scaled by {scaling:g}" if scaling != 1.0 else ""
    if custom:
        why = "the layer's custom routing function, which the experts call does not pass"
    elif expert_parallel:
        why = "expert parallelism: the op routes among the experts it holds, a rank holds a share"
    elif routing.scoring_func not in ("softmax", "sigmoid"):
        why = f"{routing.scoring_func} scores, which w4a8moe's op does not compute"
    else:
        why = "grouped top-k without num_expert_group and topk_group"
    return (f"w4a8moe: MoE routing ({text}) by vLLM's CPU router (select_experts: {why}), the "
            f"experts by w4a8moe")


def _make_experts_class():
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe import CPUExpertsInt4
    from vllm.platforms import current_platform

    import w4a8moe

    class W4A8MoeExperts(CPUExpertsInt4):
        """vLLM's monolithic CPU experts contract (router logits in), run by w4a8moe on any
        CPU. install_layer() makes a subclass per layer that sets the attributes below."""

        # the packed layer's group size (-1: one scale per row)
        group_size = None
        # The layer's custom_routing_function (Llama 4: sigmoid of the top-1 logit): the
        # monolithic call does not pass it, and FusedMoEConfig.routing_method says Default.
        routing_function = None
        # The layer's Routing (routing_of): the monolithic call passes neither the scoring
        # function nor whether the layer groups its experts (it passes num_expert_group even
        # when the layer does not group), and FusedMoEConfig.routing_method says neither.
        routing = None

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            if not current_platform.is_cpu():
                return False, "vLLM's platform is not the CPU"
            return mk.FusedMoEExperts.is_supported_config(
                cls, moe_config, weight_key, activation_key, activation_format)

        @staticmethod
        def _supports_activation(activation) -> bool:
            return getattr(activation, "value", activation) in ACTIVATIONS

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return True  # each family module checks its own scheme before it asks

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return parallel_check(moe_parallel_config)[0]

        @staticmethod
        def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
            return routing_check(routing_method)[0]

        def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts,
                  expert_map, a1q_scale=None, apply_router_weight_on_input=False,
                  num_expert_group=None, e_score_correction_bias=None,
                  routed_scaling_factor=None, topk_group=None, routing_replay_out=None,
                  routing_sink=None):
            config = self.moe_config
            routing = type(self).routing or Routing(
                "softmax",
                config.routing_method in (RoutingMethodType.Renormalize,
                                          RoutingMethodType.RenormalizeNaive),
                num_expert_group is not None)
            scaling = 1.0 if routed_scaling_factor is None else routed_scaling_factor
            name = getattr(activation, "value", activation)
            alpha = config.swiglu_alpha if config.swiglu_alpha is not None else 1.702
            limit = config.swiglu_limit if config.swiglu_limit is not None else 7.0
            if tracing():  # (formatting the token count would specialise a compiled graph)
                trace(f"forward {hidden_states.shape[0]} "
                      f"{int(bool(apply_router_weight_on_input))}"
                      f"{'' if expert_map is None else ' local'}")
            code = w4a8moe.activation_code(ACTIVATIONS[name][0])
            sizes = (config.hidden_dim, config.intermediate_size_per_partition,
                     int(type(self).group_size))
            fused = None
            if type(self).routing_function is None and expert_map is None:
                fused = op_routing(routing, num_expert_group, topk_group,
                                   e_score_correction_bias, scaling)
            if fused is not None:
                # the router's top-k inside the op: one call for the layer
                return w4a8moe.ops.moe_routed(
                    hidden_states, router_logits, w1, w2, *sizes,
                    bool(apply_router_weight_on_input), code, float(alpha), float(limit),
                    config.experts_per_token, *fused)

            from vllm.model_executor.layers.fused_moe.router.cpu_router import select_experts

            topk_weights, topk_ids = select_experts(
                custom_routing_function=type(self).routing_function,
                hidden_states=hidden_states,
                router_logits=router_logits,
                use_grouped_topk=routing.grouped,
                top_k=config.experts_per_token,
                renormalize=routing.renormalize,
                topk_group=topk_group,
                num_expert_group=num_expert_group,
                scoring_func=routing.scoring_func,
                routed_scaling_factor=scaling,
                e_score_correction_bias=e_score_correction_bias,
            )
            if expert_map is not None:
                # expert parallelism: topk_ids name global experts; the slots whose expert is
                # on another rank add nothing here (vLLM's all-reduce adds the ranks' shares)
                return w4a8moe.ops.forward_local(
                    hidden_states, topk_ids, topk_weights, w1, w2, expert_map.to(torch.int32),
                    bool(apply_router_weight_on_input), code, float(alpha), float(limit), False)
            return w4a8moe.ops.dynamic_4bit_int_moe_ex(
                hidden_states, topk_ids, topk_weights, w1, w2, *sizes,
                bool(apply_router_weight_on_input), code, float(alpha), float(limit))

    return W4A8MoeExperts


def exact_scales(layer, names: Iterable[str]) -> None:
    """Makes the layer's scale parameters float32 and NaN before vLLM loads them: the loader
    copies the checkpoint's values in (bf16, f16 or f32: all exact in float32, so nothing is
    rounded to the model's dtype), and a scale the file lacks stays NaN, which
    check_scales_loaded() reports instead of running with vLLM's placeholder. The layer's large
    parameters get huge pages first (memory.huge_pages)."""
    from . import memory

    for name in names:
        old = getattr(layer, name)
        new = torch.nn.Parameter(torch.empty(old.shape, dtype=torch.float32),
                                 requires_grad=False)
        for key, value in vars(old).items():
            if not key.startswith("_"):
                setattr(new, key, value)
        layer.register_parameter(name, new)
    memory.huge_pages(layer)
    for name in names:
        getattr(layer, name).data.fill_(float("nan"))


def check_scales_loaded(layer, names: Iterable[str]) -> None:
    prefix = getattr(layer, "layer_name", type(layer).__name__)
    for name in names:
        scale = getattr(layer, name).data
        missing = torch.isnan(scale.float()).flatten(1).any(1).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"{prefix}: {name} of expert(s) {missing} not loaded: the checkpoint lacks "
                f"their gate/up or down projection's scales")


def install_layer(method, layer, w13_packed, w2_packed, group: int, free: Iterable[str],
                  names: Tuple[str, str] = ("w13_weight", "w2_weight")) -> None:
    """Puts the packed layer in place of vLLM's tensors (those named in `free` become empty,
    as vLLM frees them), records it in the trace and builds the method's kernel: vLLM's
    prepare/finalize around a per-layer subclass of the experts class. `names`: the layer's
    parameters the method's forward hands the kernel as w1 and w2."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.utils import replace_parameter

    import w4a8moe

    nothing = torch.empty(0)
    for name in free:
        if getattr(layer, name, None) is not None:
            replace_parameter(layer, name, torch.nn.Parameter(nothing, requires_grad=False))
    for name, packed in zip(names, (w13_packed, w2_packed)):
        param = torch.nn.Parameter(packed, requires_grad=False)
        if name in layer._parameters:
            layer._parameters[name] = param
        else:
            if hasattr(layer, name):
                delattr(layer, name)
            layer.register_parameter(name, param)
    from .memory import release_freed

    release_freed()  # vLLM's tensors of this layer (and the previous one's late frees)
    info = w4a8moe.packed_info(w13_packed)
    parallel = method.moe.moe_parallel_config
    trace(f"pack {info.cols} {info.rows // 2} {info.experts} {info.group_size} "
          f"{activation_name(method.moe)} {w4a8moe.active_kernel_set()} {info.weight_format} "
          f"{w13_packed.numel() + w2_packed.numel()} tp{parallel.tp_rank}/{parallel.tp_size} "
          f"ep{parallel.ep_rank}/{parallel.ep_size}")
    attrs = {"group_size": group}
    function = getattr(layer, "custom_routing_function", None)
    if function is not None:
        attrs["routing_function"] = staticmethod(function)
    attrs["routing"] = routing_of(layer)
    if attrs["routing"] is not None:
        say(routing_plan(attrs["routing"], layer, function is not None,
                         getattr(layer, "expert_map", None) is not None))
    base = experts_class()
    experts_cls = type(base.__name__, (base,), attrs)
    prepare_finalize = maybe_make_prepare_finalize(
        moe=method.moe, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG,
        routing_tables=layer._expert_routing_tables(), allow_new_interface=True,
        use_monolithic=True)
    assert prepare_finalize is not None
    method.moe_quant_config = FUSED_MOE_UNQUANTIZED_CONFIG
    method.moe_kernel = mk.FusedMoEKernel(
        prepare_finalize,
        experts_cls(moe_config=method.moe, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG))


def bias_of(layer, name: str, loaded_only: bool = False) -> Optional[torch.Tensor]:
    """The layer's bias as float32, or None (absent, or not in the checkpoint when
    loaded_only: vLLM registers zero biases some checkpoints do not fill)."""
    bias = getattr(layer, name, None)
    if bias is None or bias.numel() == 0:
        return None
    if loaded_only and name not in getattr(layer, "_loaded_expert_biases", {name}):
        return None
    return bias.data.float()
