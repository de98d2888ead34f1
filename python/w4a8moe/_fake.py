"""Shape functions ("fake" implementations) of the forward ops (MoE and dense linear) for torch 2.

torch.compile, torch.export and FakeTensorMode run these instead of the CPU kernel: the output's
shape and dtype from the inputs' shapes and dtypes, no data read and nothing computed. Written in
Python because the token count of a compiled graph is a symbolic integer, which C++ kernels
taking concrete sizes cannot keep symbolic (they would specialise the graph to one batch size).
torch.library.register_fake also makes them the ops' Meta kernels. Torch 1.x uses the C++ Meta
kernels of csrc/torch_ops.cpp instead, which check the same things with the same sentences.
"""

import math

import torch

from ._activations import code_error, is_code

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _shape(t) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _fail(message: str):
    raise RuntimeError(message)


def _check(condition, message):
    """condition may be symbolic (a token count under torch.compile): torch._check keeps it as
    a run-time assertion instead of specialising the graph on it."""
    if isinstance(condition, bool):
        if not condition:
            _fail(message())
    else:
        torch._check(condition, message)


def _check_packed(w13_packed, w2_packed, intermediate_size, group_size):
    """The MoE ops' checks of the packed weights and the sizes passed with them."""
    if w13_packed.dtype != torch.uint8 or w2_packed.dtype != torch.uint8:
        _fail("w13_packed, w2_packed: expected uint8 tensors of packed weights, got "
              f"{w13_packed.dtype} and {w2_packed.dtype}")
    if intermediate_size < 1:
        _fail(f"intermediate_size: expected a positive value, got {intermediate_size}")
    if not (group_size == -1 or (group_size > 0 and group_size % 32 == 0)):
        _fail(f"group_size: expected -1 or a multiple of 32, got {group_size}")


def moe_ex_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden_size,
                intermediate_size, group_size, apply_router_weight_on_input, activation_kind,
                alpha=1.702, limit=7.0):
    _check_packed(w13_packed, w2_packed, intermediate_size, group_size)
    if not limit > 0.0:
        _fail(f"limit: expected a positive value, got {limit}")
    if not is_code(activation_kind):
        _fail(code_error(activation_kind))
    if x.dim() != 2:
        _fail(f"x: expected rank 2 [T, H], got shape {_shape(x)}")
    if x.shape[1] != hidden_size:
        _fail(f"x: expected {hidden_size} columns (hidden_size), got shape {_shape(x)}")
    if topk_weights.dtype not in _FLOATS:
        _fail(f"topk_weights: expected dtype float32, bfloat16 or float16, got "
              f"{topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        _fail(f"topk_ids: expected dtype int32 or int64, got {topk_ids.dtype}")
    if x.dtype not in _FLOATS:
        _fail(f"x: expected dtype f32, bf16 or f16, got {x.dtype}")
    tokens = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        _fail(f"topk_ids: expected shape [{tokens}, K], got {_shape(topk_ids)}")
    _check(topk_ids.shape[0] == tokens,
           lambda: f"topk_ids: expected shape [{tokens}, K], got {_shape(topk_ids)}")
    if topk_weights.dim() != 2 or topk_weights.shape[1] != topk_ids.shape[1]:
        _fail(f"topk_weights: expected shape {_shape(topk_ids)}, got {_shape(topk_weights)}")
    _check(topk_weights.shape[0] == topk_ids.shape[0],
           lambda: f"topk_weights: expected shape {_shape(topk_ids)}, got {_shape(topk_weights)}")
    return x.new_empty((tokens, hidden_size))


def moe_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden_size, intermediate_size,
             group_size, apply_router_weight_on_input, activation_kind):
    return moe_ex_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden_size,
                       intermediate_size, group_size, apply_router_weight_on_input,
                       activation_kind)


def forward_local_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, expert_map,
                       apply_router_weight_on_input=False, activation_kind=2, alpha=1.702,
                       limit=7.0, f32_output=False):
    if expert_map.dtype != torch.int32 or expert_map.dim() != 1:
        _fail("expert_map: expected an int32 tensor [E] (the local index of each expert, -1 "
              f"elsewhere), got dtype {expert_map.dtype} of shape {_shape(expert_map)}")
    if x.dim() != 2:
        _fail(f"x: expected rank 2 [T, H], got shape {_shape(x)}")
    # the forward op's checks; the sizes of the packed weights are checked by the CPU kernel
    out = moe_ex_fake(x, topk_ids, topk_weights, w13_packed, w2_packed, x.shape[1], 1, -1,
                      apply_router_weight_on_input, activation_kind, alpha, limit)
    return out.to(torch.float32) if f32_output else out


def linear_fake(x, w_packed, out_features):
    if w_packed.dtype != torch.uint8:
        _fail(f"w_packed: expected a uint8 tensor of packed weights, got {w_packed.dtype}")
    if x.dim() < 1:
        _fail("x: expected rank 1 or more [..., K], got a scalar")
    if x.dtype not in _FLOATS:
        _fail(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    if out_features < 1:
        _fail(f"out_features: expected a positive value, got {out_features}")
    return x.new_empty((*x.shape[:-1], out_features))


def quantize_linear_int8_fake(weight):
    if weight.dim() != 2:
        _fail(f"weight: expected rank 2 [N, K], got shape {_shape(weight)}")
    if weight.dtype not in _FLOATS:
        _fail(f"weight: expected dtype float32, bfloat16 or float16, got {weight.dtype}")
    return (weight.new_empty(weight.shape, dtype=torch.int8),
            weight.new_empty((weight.shape[0],), dtype=torch.float32))


def moe_routed_fake(x, router_logits, w13_packed, w2_packed, hidden_size, intermediate_size,
                    group_size, apply_router_weight_on_input, activation_kind, alpha, limit,
                    top_k, scoring_func, renormalize, routed_scaling_factor=1.0,
                    num_expert_group=1, topk_group=1, e_score_correction_bias=None):
    """moe_routed: the routing arguments checked against E, router_logits' columns (a fake
    packed tensor has no header to read E from); the sentences of the C++ checks."""
    _check_packed(w13_packed, w2_packed, intermediate_size, group_size)
    if router_logits.dim() != 2:
        _fail(f"router_logits: expected rank 2 [T, E], got shape {_shape(router_logits)}")
    experts = router_logits.shape[1]
    source = "the columns of router_logits"
    if scoring_func not in ("softmax", "sigmoid"):
        _fail(f"scoring_func: expected 'softmax' or 'sigmoid', got '{scoring_func}'")
    if not 1 <= top_k <= experts:
        _fail(f"top_k: expected 1 to {experts} ({source}), got {top_k}")
    if not (math.isfinite(routed_scaling_factor)
            and abs(routed_scaling_factor) <= torch.finfo(torch.float32).max):
        _fail(f"routed_scaling_factor: expected a finite float32, got {routed_scaling_factor}")
    if num_expert_group < 1 or experts % num_expert_group != 0:
        _fail(f"num_expert_group: expected a divisor of {experts} ({source}), got "
              f"{num_expert_group}")
    if not 1 <= topk_group <= num_expert_group:
        _fail(f"topk_group: expected 1 to {num_expert_group} (num_expert_group), got {topk_group}")
    per_group = experts // num_expert_group
    if topk_group * per_group < top_k:
        _fail(f"topk_group: expected at least {-(-top_k // per_group)} groups of {per_group} "
              f"experts, to hold top_k = {top_k} experts, got {topk_group}")
    has_bias = e_score_correction_bias is not None
    if has_bias and num_expert_group > 1 and per_group < 2:
        _fail("num_expert_group: expected groups of 2 experts or more (with "
              "e_score_correction_bias a group scores the sum of its two best), got "
              f"{num_expert_group} groups of {per_group}")
    if x.dim() != 2:
        _fail(f"x: expected rank 2 [T, H], got shape {_shape(x)}")
    if x.shape[1] != hidden_size:
        _fail(f"x: expected {hidden_size} columns (hidden_size), got shape {_shape(x)}")
    if x.dtype not in _FLOATS:
        _fail(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    tokens = x.shape[0]
    _check(router_logits.shape[0] == tokens,
           lambda: f"router_logits: expected shape [{tokens}, {experts}] (T from x, E {source}), "
                   f"got {_shape(router_logits)}")
    if router_logits.dtype not in _FLOATS:
        _fail(f"router_logits: expected dtype float32, bfloat16 or float16, got "
              f"{router_logits.dtype}")
    if has_bias:
        if e_score_correction_bias.dim() != 1 or e_score_correction_bias.shape[0] != experts:
            _fail(f"e_score_correction_bias: expected shape [{experts}] ({source}), got "
                  f"{_shape(e_score_correction_bias)}")
        if e_score_correction_bias.dtype not in _FLOATS:
            _fail("e_score_correction_bias: expected dtype float32, bfloat16 or float16, got "
                  f"{e_score_correction_bias.dtype}")
    if not is_code(activation_kind):
        _fail(code_error(activation_kind))
    if not math.isfinite(alpha):
        _fail(f"alpha: expected a finite value, got {alpha}")
    if not limit > 0.0:
        _fail(f"limit: expected a positive value, got {limit}")
    return x.new_empty((tokens, hidden_size))

def register() -> bool:
    """Registers the shape functions where the torch version takes them from Python (2.x);
    returns whether it did."""
    if int(torch.__version__.split(".")[0]) < 2:
        return False  # the C++ Meta kernels serve torch 1.x
    register_fake = getattr(torch.library, "register_fake", None)  # 2.4 and later
    if register_fake is None:
        register_fake = torch.library.impl_abstract  # 2.2, 2.3
    register_fake("w4a8moe::dynamic_4bit_int_moe")(moe_fake)
    register_fake("w4a8moe::dynamic_4bit_int_moe_ex")(moe_ex_fake)
    register_fake("w4a8moe::forward_local")(forward_local_fake)
    register_fake("w4a8moe::linear")(linear_fake)
    register_fake("w4a8moe::quantize_linear_int8")(quantize_linear_int8_fake)
    register_fake("w4a8moe::moe_routed")(moe_routed_fake)
    return True
