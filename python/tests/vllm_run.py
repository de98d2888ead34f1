"""Runs one checkpoint folder in vLLM (the test's own process, so that each run starts a clean
engine): greedy generation from token ids, the log-probabilities over the whole vocabulary of the
next token at each prompt position (vLLM's prompt_logprobs; position 0 has none) and of the
first generated token. Prints one JSON object on the last line of stdout:
  {"tokens": [...], "logprobs": [[V floats, by token id] for positions 1 .. n]}
or {"error": "<type>: <message>"} when vLLM refuses the checkpoint.

    python vllm_run.py FOLDER --prompt 1,2,3 --tokens 4 [--vocab 256] [--tp 2 [--ep]]

--tp N runs vLLM's tensor parallelism over N worker processes (one core each:
VLLM_CPU_OMP_THREADS_BIND, set by the caller), --ep its expert parallelism over them; --compiled
runs vLLM's default mode (torch.compile) rather than enforce_eager.

W4A8MOE_TEST_VLLM_AVX2=1 runs vLLM as it runs on an x86 CPU without AVX-512 (on any host).
"""

import argparse
import json
import os
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", action="store_true")
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM's default mode (torch.compile) instead of enforce_eager")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prompt = [int(t) for t in args.prompt.split(",")]
    if os.environ.get("W4A8MOE_TEST_VLLM_AVX2") == "1":
        # vLLM as on an x86 CPU without AVX-512: it loads its AVX2 extension (which lacks the
        # CPU int4 linear op cpu_gemm_wna16) and its AVX2 attention
        import torch

        torch.cpu._is_avx512_supported = lambda: False
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.folder, dtype=args.dtype, enforce_eager=not args.compiled,
                  max_model_len=128,
                  max_num_seqs=4, max_logprobs=args.vocab, skip_tokenizer_init=True, seed=0,
                  tensor_parallel_size=args.tp, enable_expert_parallel=args.ep)
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=args.vocab,
                                prompt_logprobs=args.vocab, detokenize=False)
        request = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks the message
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 0
    out = request.outputs[0]
    steps = list(request.prompt_logprobs[1:]) + [out.logprobs[0]]
    logprobs = [[step[t].logprob if t in step else float("-inf") for t in range(args.vocab)]
                for step in steps]
    print(json.dumps({"tokens": list(out.token_ids), "logprobs": logprobs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
