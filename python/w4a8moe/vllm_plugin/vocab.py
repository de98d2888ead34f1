"""vLLM's vocabulary tables (the token embedding and the LM head), each held once in memory.

Why: vLLM's CPU platform prepares a GEMM on every vocabulary table when a model loads
(UnquantizedEmbeddingMethod.process_weights_after_loading calls dispatch_cpu_unquantized_gemm
with remove_weight=False): a oneDNN copy of the token embedding, which these models only look
up, and of the LM head, whose own table then stays beside the copy. For vocabularies of 150-200k
rows each copy is 0.6-1.2 GB that nothing reads (docs/whole-model.md, "Load and memory").

What, with the computation unchanged:
- the token embedding (a VocabParallelEmbedding that is not the LM head) keeps its table alone;
  vLLM's GEMM on it is prepared on its first call, which only a model whose logits come from the
  embedding module itself makes;
- the LM head (ParallelLMHead) gets vLLM's GEMM and lets its own reference to the table go, as
  vLLM's linear layers do (remove_weight=True). Kept when the model computes its logits in
  another dtype than the table's (vLLM's head_dtype, e.g. --hf-overrides '{"head_dtype":
  "float32"}'): vLLM then reads the table itself. A tied head's table stays the embedding's.

dense_int8 (W4A8MOE_VLLM_QUANTIZE_DENSE=int8) wraps the same function on top of this one and
takes the LM head itself.
"""

from . import core, patches


def head_dtype_differs(layer) -> bool:
    """Whether vLLM computes the logits in a dtype other than the LM head's table (it then
    reads layer.weight directly rather than through the GEMM prepared at load); True when the
    model's configuration cannot be read, so that the table is kept."""
    try:
        from vllm.config import get_current_vllm_config

        head_dtype = get_current_vllm_config().model_config.head_dtype
    except Exception:  # no model configuration in this process: keep the table
        return True
    return head_dtype != layer.weight.dtype


def kind_of(layer):
    """'head', 'embedding' or None (not a vocabulary table with a 2-D weight)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    weight = getattr(layer, "weight", None)
    if weight is None or weight.is_meta or weight.dim() != 2:
        return None
    if isinstance(layer, ParallelLMHead):
        return "head"
    return "embedding" if isinstance(layer, VocabParallelEmbedding) else None


def _lazy(layer, vllm_dispatch) -> None:
    """The embedding's GEMM, prepared by vLLM on the first call (if one comes)."""

    def cpu_linear(x, weight, bias, layer=layer):
        vllm_dispatch(layer, False)  # sets layer.cpu_linear to vLLM's GEMM
        return layer.cpu_linear(x, weight, bias)

    layer.cpu_linear = cpu_linear


def _hold_once(vllm_dispatch):
    """The vocabulary tables' dispatch: the embedding's GEMM made lazily, the head's table let go
    where vLLM's GEMM holds it."""

    def dispatch(layer, remove_weight):
        rows, cols = layer.weight.shape
        if kind_of(layer) == "embedding":
            _lazy(layer, vllm_dispatch)
            core.trace(f"vocab embedding {rows} {cols} lazy")
            core.say("w4a8moe: the token embedding keeps its table alone; vLLM's GEMM on it is "
                     "prepared on its first call, if one comes")
            return None
        keep = head_dtype_differs(layer)
        vllm_dispatch(layer, remove_weight or not keep)
        core.trace(f"vocab head {rows} {cols} {'kept' if keep else 'dropped'}")
        if not keep:
            core.say("w4a8moe: the LM head's table is held once (in vLLM's GEMM)")
        return None

    return dispatch


def _is_table(layer, remove_weight) -> bool:
    return kind_of(layer) is not None


def install() -> None:
    patches.replace("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", __name__,
                    lambda vllm: core.wrap(vllm, _hold_once(vllm), _is_table))
