"""Packing straight from the quantized layouts checkpoints ship: GPTQ ("gptq", "gptq_v2"), AWQ,
compressed-tensors pack-quantized int4 and MXFP4, the tensors as the file (or an engine's loader)
holds them. The library decodes them expert by expert into its packed layout, exactly (zero
points, act-order and codes kept), with no unpacked copy of the layer (docs/checkpoints.md,
include/w4a8moe/checkpoint.hpp).

Layouts of one projection stack (E experts, N outputs, K inputs, G groups):

  format               weight             scale            zero_point        g_idx
  gptq, gptq_v2        int32 [E, K/8, N]  [E, G, N] float  int32 [E, G, N/8] [E, K]
  awq                  int32 [E, K, N/8]  [E, G, N] float  int32 [E, G, N/8] -
  compressed-tensors   int32 [E, N, K/8]  [E, N, G] float  int32 [E, N/8, G] [E, K]
  mxfp4                uint8 [E, N, K/2]  uint8 [E, N, K/32]  -             -

w13 is the gate and up projections stacked (N = 2I, K = H), w2 the down projection (N = H,
K = I). An absent zero_point means symmetric weights; a g_idx other than k / g_size is act-order.
Errors are RuntimeError naming the tensor ("w13.zero_point", "w2.g_idx", ...).
"""

from typing import Optional, Sequence, Tuple

import torch

ops = torch.ops.w4a8moe

FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors", "mxfp4")


def pack_checkpoint_moe(
    format: str,
    w13_weight: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
    *,
    w13_zero_point: Optional[torch.Tensor] = None,
    w2_zero_point: Optional[torch.Tensor] = None,
    w13_g_idx: Optional[torch.Tensor] = None,
    w2_g_idx: Optional[torch.Tensor] = None,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    gate_up_layout: str = "halves",
    kernel_set: str = "",
    experts: Optional[Sequence[int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's tensors in `format` -> (w13_packed, w2_packed) for w4a8moe's MoE ops.
    group_size: -1 (one group per row) or g (mxfp4: 32). gate_up_layout: "halves" or
    "interleaved" (gpt-oss). experts: the experts to pack, in this order (None: all)."""
    return ops.pack_checkpoint_moe(
        format, w13_weight, w13_scale, w2_weight, w2_scale, group_size, w13_zero_point,
        w2_zero_point, _g_idx(w13_g_idx), _g_idx(w2_g_idx), w13_bias, w2_bias, gate_up_layout,
        kernel_set, None if experts is None else [int(e) for e in experts])


def pack_checkpoint_linear(
    format: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    *,
    zero_point: Optional[torch.Tensor] = None,
    g_idx: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    kernel_set: str = "",
) -> torch.Tensor:
    """A dense layer in `format` (the layouts above without E) -> the buffer w4a8moe.linear
    takes. Act-order is refused (a dense layer packs its inputs in order)."""
    return ops.pack_checkpoint_linear(format, weight, scale, group_size, zero_point,
                                      _g_idx(g_idx), bias, kernel_set)


def _g_idx(g_idx):
    """An empty g_idx (vLLM registers one when there is no act-order) is none."""
    return None if g_idx is None or g_idx.numel() == 0 else g_idx


def register_fake() -> None:
    """Fake kernels for torch 2 (meta tensors, FakeTensorMode): the packed size depends on
    g_idx's values (an input order is kept only for act-order), so it is a data-dependent size."""
    if not hasattr(torch.library, "register_fake"):
        return

    def sized(*tensors):
        ctx = torch.library.get_ctx()
        return [tensors[0].new_empty((ctx.new_dynamic_size(),), dtype=torch.uint8)
                for _ in range(2)]

    @torch.library.register_fake("w4a8moe::pack_checkpoint_moe")
    def _moe(format, w13_weight, *rest):
        w13, w2 = sized(w13_weight)
        return w13, w2

    @torch.library.register_fake("w4a8moe::pack_checkpoint_linear")
    def _linear(format, weight, *rest):
        return sized(weight)[0]
