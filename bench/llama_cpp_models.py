"""The GGUF files of bench/llama_cpp.py: the model shapes of bench/vllm_engine_models.py at any
depth (`layers`) and vocabulary (`vocab`), with random but valid blocks, in the tensor types a
llama.cpp user runs, so that llama.cpp can sit in the same table as vLLM and w4a8moe.

  qwen3-30b-a3b  H 2048, MoE I 768, 128 experts, top-8; attention 32 heads, 4 KV heads, head 128.
                 The types llama-quantize gives a Q4_0 model: Q4_0 attention, experts and token
                 embedding, Q6_K output (LM head); F32 norms and router. Full depth: 48 layers,
                 vocabulary 151936, about 17 GB.
  gpt-oss-20b    H 2880, I 2880, 32 experts, top-4, swigluoai with biases; attention 64 heads,
                 8 KV heads, head 64, sinks, sliding window 128 on every other layer, YaRN rope.
                 The types of ggml-org's gpt-oss-20b GGUF: MXFP4 experts, Q8_0 attention, token
                 embedding and output; F32 norms, sinks, biases and router. Full depth: 24
                 layers, vocabulary 201088, about 12 GB (as ggml-org's file).

Tensor names, shapes (merged `blk.N.ffn_{gate,up,down}_exps` expert tensors) and KV metadata are
those of llama.cpp's convert_hf_to_gguf.py and src/models/{qwen3moe,openai-moe}.cpp at the pinned
commit. The vocabulary is an SPM-style list (tokenizer.ggml.model "llama": <unk>, <s>, </s>, the
256 byte tokens, then plain tokens), which llama.cpp loads; its benchmarks feed token ids, so
the real tokenizers are not needed.

Random blocks keep activations of order one, like bench/vllm_engine_models.py's weights: a
linear layer of K inputs gets rows of RMS about 1/sqrt(K), the token embedding entries of RMS
about 1. Per block (ggml-common.h): Q4_0 an fp16 scale then 16 bytes of nibbles (value
d * (q - 8)); Q8_0 an fp16 scale then 32 int8 (-128 avoided, as ggml's quantizer does); Q6_K 128
bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-block scales and an fp16 scale (value
d * scale * (q - 32)), so every byte pattern but the scale is valid; MXFP4 an e8m0 exponent
byte then 16 bytes of e2m1 nibbles (value e2m1 * 2^(e - 127)), exponents within one of the one
nearest the row RMS (119..121 at 2880 inputs, as bench/vllm_engine_models.py's). Every scale is
finite and non-zero (Q6_K's fp16 ones subnormal, as in files llama-quantize writes).

Memory stays bounded by one tensor, never the model: the tensor infos go first (GGUFWriter's
add_tensor_info with the raw type and byte shape), then the header, KV data and tensor infos are
written, then each tensor is generated just before its bytes are written (in chunks of rows, so
the temporaries stay small). The largest tensor is gpt-oss's token embedding at full vocabulary
(0.6 GB).

Files are cached under `root` by a tag of (shape, layers, vocab) and written to a .part file
renamed at the end, so an interrupted write is never reused.

    "$(scripts/llama-cpp-env.sh --python)" bench/llama_cpp_models.py --shape gpt-oss-20b \\
        --layers 2 --vocab 4096 --root /tmp/w4a8moe-llama-cpp-bench
"""

import argparse
import math
import os
import pathlib
import shutil
import sys

SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")

_CHUNK_BYTES = 32 << 20  # rows generated at a time: bounds the temporaries beside the tensor
_SEED = 0


def _linear(name, shape, type_name, bias):
    """A linear layer's weight [..., rows, cols] in `type_name` (rows of RMS 1/sqrt(cols)) and,
    unless bias is None, its F32 bias [..., rows] of that fill."""
    out = [(name + ".weight", shape, type_name, shape[-1] ** -0.5)]
    if bias is not None:
        out.append((name + ".bias", shape[:-1], "F32", bias))
    return out


def _tensors(shape, layers, vocab):
    """The (name, numpy shape (outermost first), type name, fill) of every tensor, in file order.
    fill: the target RMS of a quantized tensor's values, else "ones", "zeros" or ("randn", std)
    for F32."""
    if shape == "qwen3-30b-a3b":
        H, I, E, HEADS, KV, HD = 2048, 768, 128, 32, 4, 128
        embd, attn, experts, output = "Q4_0", "Q4_0", "Q4_0", "Q6_K"
    elif shape == "gpt-oss-20b":
        H, I, E, HEADS, KV, HD = 2880, 2880, 32, 64, 8, 64
        embd, attn, experts, output = "Q8_0", "Q8_0", "MXFP4", "Q8_0"
    else:
        raise ValueError(f"unknown shape {shape!r} (expected one of {', '.join(SHAPES)})")
    gpt_oss = shape == "gpt-oss-20b"  # biases, sinks; no q/k norms
    out = [("token_embd.weight", (vocab, H), embd, 1.0)]
    for i in range(layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (H,), "F32", "ones"))
        for name, rows, cols in (("attn_q", HEADS * HD, H), ("attn_k", KV * HD, H),
                                 ("attn_v", KV * HD, H), ("attn_output", H, HEADS * HD)):
            out += _linear(b + name, (rows, cols), attn, "zeros" if gpt_oss else None)
        if gpt_oss:
            out += [(b + "attn_sinks.weight", (HEADS,), "F32", "zeros"),
                    (b + "post_attention_norm.weight", (H,), "F32", "ones")]
        else:
            out += [(b + "attn_q_norm.weight", (HD,), "F32", "ones"),
                    (b + "attn_k_norm.weight", (HD,), "F32", "ones"),
                    (b + "ffn_norm.weight", (H,), "F32", "ones")]
        out.append((b + "ffn_gate_inp.weight", (E, H), "F32", ("randn", H ** -0.5)))
        if gpt_oss:
            out.append((b + "ffn_gate_inp.bias", (E,), "F32", "zeros"))
        for name, rows, cols in (("ffn_gate_exps", I, H), ("ffn_up_exps", I, H),
                                 ("ffn_down_exps", H, I)):
            out += _linear(b + name, (E, rows, cols), experts, ("randn", 0.1) if gpt_oss else None)
    out += [("output_norm.weight", (H,), "F32", "ones"),
            ("output.weight", (vocab, H), output, H ** -0.5)]
    return out


def _metadata(writer, shape, layers, vocab):
    """The KV data llama.cpp reads for the architecture (convert_hf_to_gguf.py's keys) and the
    vocabulary."""
    from gguf import LlamaFileType, RopeScalingType, TokenType

    w = writer
    w.add_name(f"synthetic {shape} ({layers} layers, vocabulary {vocab})")
    w.add_block_count(layers)
    if shape == "qwen3-30b-a3b":
        w.add_context_length(40960)
        w.add_embedding_length(2048)
        w.add_feed_forward_length(6144)
        w.add_head_count(32)
        w.add_head_count_kv(4)
        w.add_rope_freq_base(1000000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(128)
        w.add_expert_used_count(8)
        w.add_key_length(128)
        w.add_value_length(128)
        w.add_expert_feed_forward_length(768)
        w.add_file_type(LlamaFileType.MOSTLY_Q4_0)
    else:
        w.add_context_length(131072)
        w.add_embedding_length(2880)
        w.add_feed_forward_length(2880)
        w.add_head_count(64)
        w.add_head_count_kv(8)
        w.add_rope_freq_base(150000.0)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_expert_count(32)
        w.add_expert_used_count(4)
        w.add_key_length(64)
        w.add_value_length(64)
        w.add_sliding_window(128)  # every other layer, from layer 0 (llama.cpp's pattern of 2)
        w.add_expert_feed_forward_length(2880)
        w.add_file_type(LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(2)
    special = ["<unk>", "<s>", "</s>"]
    plain = vocab - len(special) - 256
    w.add_tokenizer_model("llama")
    w.add_token_list(special + [f"<0x{b:02X}>" for b in range(256)]
                     + [f"\u2581t{i}" for i in range(plain)])
    w.add_token_scores([0.0] * (len(special) + 256) + [-float(i) for i in range(plain)])
    w.add_token_types([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
                      + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * plain)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _nbytes(shape, qtype):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if shape[-1] % block:
        raise ValueError(f"{qtype} rows of {shape[-1]} values are not whole blocks of {block}")
    return math.prod(shape[:-1]) * (shape[-1] // block) * type_size


def _f16_bytes(values):
    """float32 scales -> the (n, 2) little-endian bytes of their fp16."""
    import numpy as np

    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _fill_blocks(rng, blocks, qtype, rms):
    """Random valid `qtype` blocks, in place, whose values have an RMS of about `rms`.
    blocks: a (n, type_size) uint8 array (a view into the tensor)."""
    import numpy as np

    n = blocks.shape[0]
    flat = blocks.reshape(-1)
    flat[:] = rng.bit_generator.random_raw((flat.size + 7) // 8).view(np.uint8)[:flat.size]
    jitter = rng.random(n, dtype=np.float32) * 0.5 + 0.75  # a spread of block scales
    if qtype == "Q4_0":
        # q - 8 over q in 0..15: RMS sqrt(21.5)
        blocks[:, 0:2] = _f16_bytes(jitter * (rms / math.sqrt(21.5)))
    elif qtype == "Q8_0":
        qs = blocks[:, 2:]
        qs[qs == 0x80] = 0x81  # int8 -128 -> -127: ggml's quantizer stays within +-127
        # int8 in -127..127: RMS sqrt(127 * 128 / 3)
        blocks[:, 0:2] = _f16_bytes(jitter * (rms / math.sqrt(127 * 128 / 3)))
    elif qtype == "Q6_K":
        # ql[128] qh[64] scales[16] (int8, random) d; q - 32 over q in 0..63: RMS sqrt(341.5);
        # int8 scales in -128..127: RMS sqrt(5461.5)
        blocks[:, 208:210] = _f16_bytes(jitter * (rms / math.sqrt(341.5 * 5461.5)))
    elif qtype == "MXFP4":
        # e2m1 values (0, 0.5, ... 6, either sign): RMS sqrt(8.5625); exponent bias 127
        e = 127 + round(math.log2(rms / math.sqrt(8.5625)))
        blocks[:, 0] = rng.integers(e - 1, e + 2, n, dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype}")


def _generate(rng, shape, qtype, fill):
    """One tensor's bytes (a flat uint8 array of _nbytes, or float32 for F32)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype == "F32":
        if fill == "ones":
            return np.ones(shape, np.float32)
        if fill == "zeros":
            return np.zeros(shape, np.float32)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(fill[1])
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    per_row = shape[-1] // block
    rows = math.prod(shape[:-1])
    blocks = np.empty((rows * per_row, type_size), np.uint8)
    step = max(1, _CHUNK_BYTES // (per_row * type_size)) * per_row
    for start in range(0, blocks.shape[0], step):
        _fill_blocks(rng, blocks[start:start + step], qtype, fill)
    return blocks.reshape(-1)


def model_bytes(shape, layers, vocab):
    """The bytes of the tensors of a file (its size less the header, within alignment)."""
    return sum(_nbytes(s, q) if q != "F32" else 4 * math.prod(s)
               for _, s, q, _ in _tensors(shape, layers, vocab))


def write(shape, root, layers, vocab):
    """Writes (once) the GGUF file of `shape` at `layers` and `vocab` under `root`; returns its
    path."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    if layers < 1:
        raise ValueError(f"layers must be at least 1 (got {layers})")
    if vocab < 512:
        raise ValueError(f"vocab must be at least 512 (3 special and 256 byte tokens; got {vocab})")
    kind = {"qwen3-30b-a3b": "q4_0", "gpt-oss-20b": "mxfp4"}[shape]
    path = os.path.join(root, f"{shape}-{kind}-L{layers}-V{vocab}.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(root, exist_ok=True)
    tensors = _tensors(shape, layers, vocab)
    total = model_bytes(shape, layers, vocab)
    free = shutil.disk_usage(root).free
    if free < total + (1 << 30):
        raise RuntimeError(f"{root} has {free / 1e9:.1f} GB free; {os.path.basename(path)} needs "
                           f"{total / 1e9:.1f} GB")
    print(f"writing {path} ({total / 1e9:.2f} GB)", file=sys.stderr, flush=True)
    part = path + ".part"
    writer = GGUFWriter(None, {"qwen3-30b-a3b": "qwen3moe", "gpt-oss-20b": "gpt-oss"}[shape])
    try:
        _metadata(writer, shape, layers, vocab)
        for name, s, qtype, _ in tensors:
            if qtype == "F32":
                writer.add_tensor_info(name, s, np.dtype(np.float32), 4 * math.prod(s))
            else:
                nbytes = _nbytes(s, qtype)
                byte_shape = (*s[:-1], nbytes // math.prod(s[:-1]))
                writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                                       raw_dtype=GGMLQuantizationType[qtype])
        writer.write_header_to_file(path=pathlib.Path(part))
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(_SEED)
        for _, s, qtype, fill in tensors:
            writer.write_tensor_data(_generate(rng, s, qtype, fill))
        writer.close()
        os.replace(part, path)
    except BaseException:
        writer.close()
        if os.path.exists(part):
            os.remove(part)
        raise
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "w4a8moe-llama-cpp-bench"))
    args = parser.parse_args()
    print(write(args.shape, args.root, args.layers, args.vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
