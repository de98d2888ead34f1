"""Expert parallelism over torch.distributed: each rank of a process group holds a share of a
MoE layer's experts (docs/pytorch.md, "Expert parallelism with torch.distributed").

    import torch.distributed as dist, w4a8moe.distributed as ep
    dist.init_process_group("gloo", ...)
    layer = ep.ExpertParallelMoE.from_weights(w13, w2, w13_scale, w2_scale, group_size=128,
                                              mode="dispatch")      # packs this rank's experts
    out = layer(x, topk_ids, topk_weights)

Two ways to run the layer:

  all_reduce  every rank has all tokens: each computes the f32 partial sums of its experts
              (torch.ops.w4a8moe.forward_local), dist.all_reduce adds them, the sum is converted
              to x's dtype;
  dispatch    each rank has its own tokens: the records of the tokens that chose another rank's
              experts (rows already quantized to int8) go there with all_to_all_single, are
              computed there, and their results (f32 or bf16) come back to be combined
              (torch.classes.w4a8moe.Dispatch); with exact=True a rank returns an f32 row per
              slot, combined in the single-process forward's order: the single-process bits on
              any number of ranks.

Construction is collective: the ranks exchange their configuration and expert maps and check
that they agree and that every expert is held by exactly one rank; a bad input raises the same
RuntimeError on every rank instead of leaving the others waiting.
"""

import struct
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import Activation, activation_code, ops, pack, packed_info

__all__ = ["MODES", "ExpertParallelMoE", "even_split_expert_map", "shard_experts"]

#: The ways of running the layer.
MODES = ("all_reduce", "dispatch")
_RESULT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Room for one rank's error message in the agreement at construction (longer ones are cut).
_MESSAGE_BYTES = 512
_PREFIX = "w4a8moe.distributed: "


def even_split_expert_map(experts: int, rank: int, ranks: int) -> torch.Tensor:
    """The expert map (int32 [E]: local index of each expert, -1 elsewhere) of `rank` when
    `experts` are split in contiguous ranges over `ranks` as evenly as can be (the first
    experts % ranks ranks hold one more)."""
    return ops.even_split_expert_map(experts, rank, ranks)


def shard_experts(expert_map: torch.Tensor) -> torch.Tensor:
    """Checks an expert map; returns the global expert of each local one (int32 [local])."""
    return ops.shard_experts(expert_map)


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


# What the ranks must agree on, in the order of the exchanged vector (after the status).
_FIELDS = [
    ("experts", "the number of experts (expert_map's length)"),
    ("hidden", "the hidden size"),
    ("inter", "the intermediate size"),
    ("group_size", "the group size"),
    ("activation", "the activation"),
    ("on_input", "apply_router_weight_on_input"),
    ("alpha", "alpha"),
    ("limit", "limit"),
    ("mode", "the mode"),
    ("result_dtype", "the result dtype"),
    ("exact", "exact results"),
]


def _agree(group, error: Optional[str], config: Dict[str, int]) -> None:
    """Collective: every rank learns each rank's status and configuration (one all_gather of a
    small int64 tensor, one of the error text), and every rank raises the same RuntimeError when
    any rank failed or the ranks disagree. Nothing here can leave a rank waiting: each rank makes
    the same two calls whatever happened before."""
    ranks = dist.get_world_size(group)
    mine = torch.tensor([0 if error is None else 1] + [config.get(k, 0) for k, _ in _FIELDS],
                        dtype=torch.int64)
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if error is not None:
        raw = error.encode("utf-8")[:_MESSAGE_BYTES]
        text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    vectors = [torch.empty_like(mine) for _ in range(ranks)]
    texts = [torch.empty_like(text) for _ in range(ranks)]
    dist.all_gather(vectors, mine, group=group)
    dist.all_gather(texts, text, group=group)
    failed = [r for r in range(ranks) if vectors[r][0].item() != 0]
    if failed:
        said = [bytes(texts[r].tolist()).rstrip(b"\0").decode("utf-8", "replace") for r in failed]
        raise RuntimeError(_PREFIX + "; ".join(f"rank {r}: {s}" for r, s in zip(failed, said)))
    for i, (name, what) in enumerate(_FIELDS, start=1):
        values = [vectors[r][i].item() for r in range(ranks)]
        if any(v != values[0] for v in values):
            if name in ("alpha", "limit"):
                values = [struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
            if name == "mode":
                values = [MODES[v] for v in values]
            if name == "exact":
                values = [bool(v) for v in values]
            have = ", ".join(f"rank {r} has {v}" for r, v in enumerate(values))
            raise RuntimeError(f"{_PREFIX}the ranks disagree on {what}: {have}")


def _check_local(w13_packed, w2_packed, expert_map, mode, activation, result_dtype, exact):
    """This rank's own checks -> (config, local experts). Raises RuntimeError or ValueError."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if result_dtype not in _RESULT_DTYPES:
        raise ValueError(f"result_dtype: expected torch.float32 or torch.bfloat16, got "
                         f"{result_dtype}")
    if exact and mode != "dispatch":
        raise ValueError(f"exact: expected mode 'dispatch' (the all_reduce way adds the ranks' "
                         f"partial sums), got {mode!r}")
    if exact and result_dtype != torch.float32:
        raise ValueError(f"result_dtype: expected torch.float32 with exact results (a row per "
                         f"slot), got {result_dtype}")
    code = activation_code(activation)
    if code not in {a.value for a in Activation}:
        raise ValueError(f"activation: expected a code in [0, {len(Activation) - 1}], got {code}")
    local = shard_experts(expert_map)
    w13 = packed_info(w13_packed)
    w2 = packed_info(w2_packed)
    for name, info, role in (("w13_packed", w13, "w13"), ("w2_packed", w2, "w2")):
        if info.role != role:
            raise RuntimeError(f"{name}: expected weights packed as {role}, got a buffer packed "
                               f"as {info.role}")
        if info.experts != local.numel():
            raise RuntimeError(f"{name}: expected the shard's {local.numel()} local experts "
                               f"(expert_map), got {info.experts}")
    if (w2.rows, w2.cols) != (w13.cols, w13.rows // 2) or w2.group_size != w13.group_size:
        raise RuntimeError(f"w2_packed: expected [{w13.cols}, {w13.rows // 2}] per expert with "
                           f"group size {w13.group_size} (from w13_packed), got [{w2.rows}, "
                           f"{w2.cols}] with group size {w2.group_size}")
    config = {"experts": expert_map.numel(), "hidden": w13.cols, "inter": w13.rows // 2,
              "group_size": w13.group_size, "activation": code, "mode": MODES.index(mode),
              "result_dtype": list(_RESULT_DTYPES).index(result_dtype), "exact": int(exact)}
    return config, local


class ExpertParallelMoE(torch.nn.Module):
    """The MoE layer over the ranks of a process group, each holding the experts of its
    expert map (docs/pytorch.md, "Expert parallelism with torch.distributed").

    w13_packed, w2_packed: this rank's experts, packed in local order (w4a8moe.pack(...,
    experts=shard_experts(expert_map))), or use from_weights(). expert_map: int32 [E], the local
    index of each global expert, -1 where another rank holds it. mode: "all_reduce" (every rank
    passes all tokens and gets the whole output) or "dispatch" (each rank passes its own tokens
    and gets their output). result_dtype (dispatch): the dtype in which results travel back,
    torch.float32 or torch.bfloat16 (half the bytes, one bf16 rounding per result row).
    exact (dispatch, f32 results): a rank returns one f32 row per (record, local slot) and the
    rows are added in the single-process forward's order: w4a8moe.moe's bits on any number of
    ranks, for up to K rows back per token instead of one per rank holding its experts.

    Construction is collective over `group` (default: the default group); so is every call.
    """

    def __init__(self, w13_packed: torch.Tensor, w2_packed: torch.Tensor,
                 expert_map: torch.Tensor, *, mode: str = "all_reduce", group=None,
                 activation="silu", apply_router_weight_on_input: bool = False,
                 alpha: float = 1.702, limit: float = 7.0,
                 result_dtype: torch.dtype = torch.float32, exact: bool = False,
                 _error: Optional[str] = None):
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_world_size(group)
        config = {"on_input": int(bool(apply_router_weight_on_input)),
                  "alpha": _float_bits(alpha), "limit": _float_bits(limit)}
        if isinstance(expert_map, torch.Tensor) and expert_map.dtype == torch.int64:
            expert_map = expert_map.to(torch.int32)
        error = _error
        if error is None:
            try:
                own, _ = _check_local(w13_packed, w2_packed, expert_map, mode, activation,
                                      result_dtype, bool(exact))
                config.update(own)
            except (RuntimeError, ValueError, TypeError) as e:
                error = str(e)
        _agree(group, error, config)

        # Everyone agrees on E: gather the maps and check that they cover each expert once.
        # Every rank holds the same maps, so every rank raises the same error, or none does.
        experts = config["experts"]
        maps = [torch.empty(experts, dtype=torch.int32) for _ in range(self.ranks)]
        dist.all_gather(maps, expert_map.to(torch.int32).contiguous(), group=group)
        self.expert_maps = torch.stack(maps)
        try:
            self.owners = ops.expert_owners(self.expert_maps)
        except RuntimeError as e:
            raise RuntimeError(_PREFIX + str(e)) from None

        self.mode = mode
        self.register_buffer("w13_packed", w13_packed, persistent=False)
        self.register_buffer("w2_packed", w2_packed, persistent=False)
        self.register_buffer("expert_map", expert_map.to(torch.int32), persistent=False)
        self.hidden = config["hidden"]
        self.activation = config["activation"]
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.result_dtype = result_dtype
        self.exact = bool(exact)
        self._dispatches = {}  # top_k -> torch.classes.w4a8moe.Dispatch

    @classmethod
    def from_weights(cls, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                     w2_scale: torch.Tensor, group_size: int = -1,
                     w13_bias: Optional[torch.Tensor] = None,
                     w2_bias: Optional[torch.Tensor] = None, *,
                     expert_map: Optional[torch.Tensor] = None, group=None,
                     gate_up_layout: str = "halves", scale_storage: str = "as_given",
                     kernel_set: str = "", **options) -> "ExpertParallelMoE":
        """Packs this rank's experts of the layer's logical weights (all E experts, as
        w4a8moe.pack takes them) and builds the layer. expert_map: this rank's map; default
        the even split of the E experts over the group's ranks. A rank whose packing fails
        makes every rank raise."""
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        error, packed = None, (None, None)
        try:
            if expert_map is None:
                expert_map = even_split_expert_map(w13.shape[0], rank, ranks)
            packed = pack(w13, w2, w13_scale, w2_scale, group_size, w13_bias, w2_bias,
                          gate_up_layout=gate_up_layout, scale_storage=scale_storage,
                          kernel_set=kernel_set, experts=shard_experts(expert_map).tolist())
        except (RuntimeError, ValueError, TypeError) as e:
            error = str(e)
            expert_map = torch.empty(0, dtype=torch.int32)
        return cls(packed[0], packed[1], expert_map, group=group, _error=error, **options)

    def _dispatch_for(self, top_k: int):
        d = self._dispatches.get(top_k)
        if d is None:
            d = torch.classes.w4a8moe.Dispatch(
                self.expert_maps, self.rank, self.hidden, top_k,
                self.apply_router_weight_on_input, self.activation, self.alpha, self.limit,
                _RESULT_DTYPES[self.result_dtype], self.exact)
            self._dispatches[top_k] = d
        return d

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """out [T, H] in x's dtype. all_reduce: every rank passes the same tokens; dispatch:
        each rank its own (any count, 0 included). topk_ids name global experts."""
        if self.mode == "all_reduce":
            return self._all_reduce(x, topk_ids, topk_weights)
        return self._dispatch(x, topk_ids, topk_weights)

    def _all_reduce(self, x, topk_ids, topk_weights):
        # The partial sums and, in one more element, the number of ranks that failed: a rank
        # whose input is refused still takes part in the sum, so that no rank waits.
        tokens = x.shape[0] if x.dim() > 0 else 0
        flat = torch.zeros(tokens * self.hidden + 1, dtype=torch.float32)
        error = None
        try:
            part = ops.forward_local(x, topk_ids, topk_weights, self.w13_packed, self.w2_packed,
                                     self.expert_map, self.apply_router_weight_on_input,
                                     self.activation, self.alpha, self.limit, True)
            flat[:-1].view(tokens, self.hidden).copy_(part)
        except RuntimeError as e:
            error = e
            flat.zero_()
            flat[-1] = 1.0
        dist.all_reduce(flat, group=self.group)
        if error is not None:
            raise error
        if flat[-1].item() != 0.0:
            raise RuntimeError(f"{_PREFIX}{int(flat[-1].item())} other rank(s) refused their "
                               "input to forward_local (each raised its error)")
        out = flat[:-1].view(tokens, self.hidden)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _dispatch(self, x, topk_ids, topk_weights):
        ranks = self.ranks
        top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
        error = None
        try:
            d = self._dispatch_for(top_k)
            counts, records = d.pack(x, topk_ids, topk_weights)
        except RuntimeError as e:
            error = e
            counts = torch.zeros(ranks, dtype=torch.int64)
            records = torch.empty(0, dtype=torch.uint8)
        # Step 0, counts: to each rank (records for it, status, top_k); every rank learns
        # everyone's status and top_k, so that all raise or none does.
        status = 0 if error is None else 1
        message = torch.stack([counts, torch.full((ranks,), status, dtype=torch.int64),
                               torch.full((ranks,), top_k, dtype=torch.int64)], dim=1)
        got = torch.empty(ranks, 3, dtype=torch.int64)
        dist.all_to_all_single(got, message.contiguous(), group=self.group)
        if error is not None:
            raise error
        failed = [r for r in range(ranks) if got[r, 1].item() != 0]
        if failed:
            raise RuntimeError(f"{_PREFIX}rank(s) {', '.join(map(str, failed))} refused their "
                               "input to dispatch (each raised its error)")
        ks = got[:, 2].tolist()
        if any(k != top_k for k in ks):
            have = ", ".join(f"rank {r} has {k}" for r, k in enumerate(ks))
            raise RuntimeError(f"{_PREFIX}the ranks disagree on top_k: {have}")
        recv_counts = got[:, 0].contiguous()
        # Step 1, records: to the ranks holding the experts.
        rb = d.record_bytes()
        received = torch.empty(int(recv_counts.sum().item()) * rb, dtype=torch.uint8)
        dist.all_to_all_single(received, records, _splits(recv_counts, rb),
                               _splits(counts, rb), group=self.group)
        results = d.compute(received, recv_counts, self.w13_packed, self.w2_packed)
        # Step 2, results: back to the ranks the records came from, counted in rows (a row per
        # record, or with exact results per slot of it held here): result_counts() out,
        # returned_counts() in.
        row = d.result_row_bytes()
        rows_in = d.returned_counts()
        returned = torch.empty(int(rows_in.sum().item()) * row, dtype=torch.uint8)
        dist.all_to_all_single(returned, results, _splits(rows_in, row),
                               _splits(d.result_counts(), row), group=self.group)
        return d.combine(returned)


def _splits(counts: torch.Tensor, row_bytes: int) -> List[int]:
    return [int(c) * row_bytes for c in counts.tolist()]
