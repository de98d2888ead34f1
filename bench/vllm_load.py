"""A bounded load on vLLM's OpenAI server with the plugin: the server command docs/vllm.md gives
(python/tests/vllm_serve.py reads it from the page) on 127.0.0.1, a tiny Qwen3-MoE checkpoint
by compressed-tensors (W4A8, or the same weights dequantized in bfloat16: vLLM's own MoE path),
and a client that keeps up to --concurrency completions in flight through the `openai` client a
user would use:

- --requests completions, prompts of 1 to --max-prompt tokens and outputs of 1 to --max-output
  (drawn log-uniformly, seeded; `ignore_eos`, so each answer has exactly max_tokens tokens),
  every other one streamed;
- every --hostile-every-th request a hostile one, in turn: max_tokens far beyond the model's
  length, an empty prompt, a token id outside the vocabulary; each must get vLLM's 4xx answer
  while the others keep flowing.

It checks that every request was answered (none lost, none 5xx, each with its token count), and
samples the resident memory of the server and its children (the engine core) twice a second: the
growth across the second half of the run is reported (and checked by the test). It reports
requests/s, output tokens/s, time to first token p50/p99 (streamed requests) and latency p50/p99.

    V=$(scripts/vllm-env.sh); $V/bin/python bench/vllm_load.py --requests 600 --weights both

Prints one Markdown row per weights kind and, with --json, a JSON line each. The server runs
with --enforce-eager unless --compiled (the page's command as written: torch.compile, a slower
start; per-call trace lines are then not written, only the pack lines).
"""

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
import vllm_serve  # noqa: E402

KV_BLOCK = 128  # tokens per KV cache block (vLLM's CPU default)
HOSTILE = ("huge max_tokens", "empty prompt", "invalid token id")


def make_model(root, *, hidden, intermediate, experts, top_k, layers, vocab, max_positions):
    """(W4A8 folder, bf16 folder) of one tiny Qwen3-MoE, with the word-level tokenizer."""
    import vllm_models
    from loguru import logger

    logger.disable("compressed_tensors")  # a warning per module of the tiny model

    w4a8, dense = os.path.join(root, "w4a8"), os.path.join(root, "bf16")
    vllm_models.make_checkpoint(w4a8, "qwen3_moe", group_size=32, fmt="pack-quantized",
                                float_folder=dense, hidden=hidden, intermediate=intermediate,
                                experts=experts, top_k=top_k, layers=layers, vocab=vocab,
                                max_positions=max_positions)
    for folder in (w4a8, dense):
        vllm_serve.write_tokenizer(folder, vocab)
    return w4a8, dense


def plan(requests, *, max_prompt, max_output, vocab, hostile_every, seed):
    """The requests, in order: dicts of prompt (text, or a list of token ids), max_tokens,
    stream, and hostile (None or its kind)."""
    rng = random.Random(seed)

    def log_uniform(top):
        return min(top, int(math.exp(rng.uniform(0, math.log(top + 1)))))

    out = []
    for i in range(requests):
        if hostile_every and i % hostile_every == hostile_every - 1:
            kind = HOSTILE[(i // hostile_every) % len(HOSTILE)]
            prompt, max_tokens = "w1 w2 w3", 4
            if kind == "huge max_tokens":
                max_tokens = 10 ** 7
            elif kind == "empty prompt":
                prompt = ""
            else:
                prompt = [1, 2, vocab + 1000]
            out.append(dict(prompt=prompt, max_tokens=max_tokens, stream=False, hostile=kind))
            continue
        n = max(1, log_uniform(max_prompt))
        prompt = " ".join(f"w{rng.randrange(1, vocab)}" for _ in range(n))
        out.append(dict(prompt=prompt, prompt_tokens=n, max_tokens=max(1, log_uniform(max_output)),
                        stream=i % 2 == 1, hostile=None))
    return out


async def _one(client, model, request):
    """Sends one request; returns its record: status, tokens, ttft, latency, error."""
    import openai

    start = time.monotonic()
    record = dict(hostile=request["hostile"], stream=request["stream"],
                  max_tokens=request["max_tokens"], status=None, tokens=0, ttft=None)
    common = dict(model=model, prompt=request["prompt"], max_tokens=request["max_tokens"],
                  temperature=0.0, extra_body={"ignore_eos": True})
    try:
        if request["stream"]:
            stream = await client.completions.create(
                stream=True, stream_options={"include_usage": True}, **common)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text and record["ttft"] is None:
                    record["ttft"] = time.monotonic() - start
                if chunk.usage is not None:
                    record["tokens"] = chunk.usage.completion_tokens
        else:
            answer = await client.completions.create(**common)
            record["tokens"] = answer.usage.completion_tokens
        record["status"] = 200
    except openai.APIStatusError as e:
        record["status"], record["error"] = e.status_code, str(e)[:300]
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        record["status"], record["error"] = "lost", f"{type(e).__name__}: {e}"[:300]
    record["latency"] = time.monotonic() - start
    return record


async def drive(port, requests, concurrency, timeout):
    """Sends `requests` with at most `concurrency` in flight; returns (records, seconds)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                timeout=timeout, max_retries=0)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def bounded(request):
        async with gate:
            return await _one(client, model, request)

    start = time.monotonic()
    records = await asyncio.gather(*(bounded(r) for r in requests))
    seconds = time.monotonic() - start
    await client.close()
    return list(records), seconds


class MemorySampler(threading.Thread):
    """The resident memory (bytes) of a process and all its descendants, every `period` s."""

    def __init__(self, pid, period):
        super().__init__(daemon=True)
        import psutil

        self.root, self.period, self.samples = psutil.Process(pid), period, []
        self._stop_event = threading.Event()

    def run(self):
        import psutil

        while not self._stop_event.is_set():
            total = 0
            try:
                for p in [self.root, *self.root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                return
            self.samples.append((time.monotonic(), total))
            self._stop_event.wait(self.period)

    def stop(self):
        self._stop_event.set()
        self.join()


def second_half_growth(samples):
    """Relative growth of resident memory across the second half of the samples: the median of
    the last tenth against the median of the tenth at the midpoint."""
    n = len(samples)
    if n < 20:
        return None
    tenth = max(1, n // 10)
    mid = statistics.median(s for _, s in samples[n // 2: n // 2 + tenth])
    end = statistics.median(s for _, s in samples[-tenth:])
    return end / mid - 1


def percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(records, seconds, samples):
    normal = [r for r in records if r["hostile"] is None]
    answered = [r for r in normal if r["status"] == 200]
    ttft = [r["ttft"] for r in answered if r["stream"] and r["ttft"] is not None]
    latency = [r["latency"] for r in answered]
    tokens = sum(r["tokens"] for r in answered)
    growth = second_half_growth(samples)
    return dict(requests=len(normal), answered=len(answered),
                short=sum(1 for r in answered if r["tokens"] != r["max_tokens"]),
                failed=[r for r in normal if r["status"] != 200][:5],
                hostile={kind: sorted({str(r["status"]) for r in records if r["hostile"] == kind})
                         for kind in HOSTILE if any(r["hostile"] == kind for r in records)},
                seconds=seconds, requests_per_s=len(answered) / seconds,
                output_tokens_per_s=tokens / seconds, output_tokens=tokens,
                ttft_p50=percentile(ttft, 0.5), ttft_p99=percentile(ttft, 0.99),
                latency_p50=percentile(latency, 0.5), latency_p99=percentile(latency, 0.99),
                rss_mib_mid=samples[len(samples) // 2][1] / 2 ** 20 if samples else None,
                rss_mib_end=samples[-1][1] / 2 ** 20 if samples else None,
                rss_growth_second_half=growth)


def serve_under_load(folder, requests, *, concurrency, log_path, trace_path=None,
                     max_model_len, compiled=False, timeout=900, env=None, sample_period=0.5):
    """Starts the page's server on `folder`, drives `requests`, stops it. Returns the summary,
    with the server's log tail under "error" when it did not come up."""
    # A KV cache of 1.5 full batches: vLLM hands out the free blocks in turn, so a cache of
    # gigabytes is first touched page by page over the whole run (resident memory that grows
    # with the tokens served, not a leak); this one is all touched during the first part.
    blocks = math.ceil(1.5 * concurrency * max_model_len / KV_BLOCK)

    def command_for(port):
        argv, _ = vllm_serve.server_command(folder, port)
        argv = vllm_serve.with_options(argv, {"--max-model-len": str(max_model_len),
                                              "--max-num-seqs": str(concurrency),
                                              "--block-size": str(KV_BLOCK),
                                              "--num-gpu-blocks-override": str(blocks)})
        return argv + ([] if compiled else ["--enforce-eager"])

    _, documented_env = vllm_serve.server_command(folder, 0)
    full_env = {**os.environ, **documented_env, **(env or {})}
    if trace_path is not None:
        full_env["W4A8MOE_VLLM_TRACE"] = str(trace_path)
    try:
        proc, port = vllm_serve.start_server(command_for, full_env, log_path, timeout)
    except RuntimeError as e:
        return {"error": str(e)}
    try:
        sampler = MemorySampler(proc.pid, sample_period)
        sampler.start()
        records, seconds = asyncio.run(drive(port, requests, concurrency, timeout))
        sampler.stop()
        summary = summarize(records, seconds, sampler.samples)
        summary["server_alive"] = proc.poll() is None
        return summary
    finally:
        vllm_serve.stop(proc)


def row(name, s):
    growth = s["rss_growth_second_half"]
    return (f"| {name} | {s['answered']}/{s['requests']} | {s['seconds']:.0f} | "
            f"{s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.0f} | "
            f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} | "
            f"{s['latency_p50']:.2f} / {s['latency_p99']:.2f} | "
            f"{'n/a' if growth is None else f'{100 * growth:+.1f}%'} | "
            f"{', '.join(f'{k}: {v}' for k, v in s['hostile'].items())} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=1000)
    parser.add_argument("--max-output", type=int, default=200)
    parser.add_argument("--hostile-every", type=int, default=25)
    parser.add_argument("--weights", choices=("w4a8", "bf16", "both"), default="both")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--onednn-cache", type=int, default=None,
                        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY for the server (oneDNN's default "
                        "1024 keeps one primitive per batch shape: resident memory grows over "
                        "the first minutes, on every MoE path; 0 isolates the rest)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    vocab, max_len = 256, args.max_prompt + args.max_output + 16
    requests = plan(args.requests, max_prompt=args.max_prompt, max_output=args.max_output,
                    vocab=vocab, hostile_every=args.hostile_every, seed=args.seed)
    with tempfile.TemporaryDirectory() as root:
        folders = dict(zip(("w4a8", "bf16"), make_model(
            root, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
            top_k=args.top_k, layers=args.layers, vocab=vocab, max_positions=max_len)))
        kinds = ("w4a8", "bf16") if args.weights == "both" else (args.weights,)
        env = {} if args.onednn_cache is None else {
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(args.onednn_cache)}
        print(f"{args.requests} requests, <= {args.concurrency} at once, prompts 1-"
              f"{args.max_prompt}, outputs 1-{args.max_output}; H {args.hidden} I "
              f"{args.intermediate} E {args.experts} top-{args.top_k}, {args.layers} layers; "
              f"{'compiled' if args.compiled else 'eager'}; oneDNN primitive cache "
              f"{'default' if args.onednn_cache is None else args.onednn_cache}\n")
        print("| weights (MoE path) | answered | s | req/s | out tok/s | TTFT p50 / p99 s | "
              "latency p50 / p99 s | RSS, 2nd half | hostile |")
        print("|---|---|---|---|---|---|---|---|---|")
        for kind in kinds:
            trace = os.path.join(root, f"trace-{kind}.txt")
            s = serve_under_load(folders[kind], requests, concurrency=args.concurrency,
                                 log_path=os.path.join(root, f"server-{kind}.log"),
                                 trace_path=trace, max_model_len=max_len,
                                 compiled=args.compiled, env=env)
            if "error" in s:
                sys.exit(f"{kind}: {s['error']}")
            lines = open(trace, encoding="utf-8").read().split("\n") if os.path.exists(
                trace) else []
            s["packed_layers"] = sum(1 for line in lines if " pack " in line)
            name = "W4A8 (w4a8moe)" if kind == "w4a8" else "bf16 (vLLM's own)"
            print(row(name, s), flush=True)
            if args.json:
                print(json.dumps(dict(weights=kind, **{k: v for k, v in s.items()
                                                       if k != "failed"})))
            if s["failed"]:
                print(f"  failed: {s['failed']}", file=sys.stderr)


if __name__ == "__main__":
    main()
