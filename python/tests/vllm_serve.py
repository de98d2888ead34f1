"""Serves one checkpoint folder with vLLM's OpenAI-compatible server, started by the command
docs/vllm.md gives a user (read from that page, so that the page and the test cannot drift
apart), and asks it what python/tests/vllm_run.py asks vllm.LLM, through the `openai` client a
user would use: greedy completion of a text prompt, with the log-probabilities over the whole
vocabulary at each prompt position (`echo` with `logprobs`) and at the first generated token.
A streamed request must give the same text; a hostile one (max_tokens beyond the model's
length) vLLM's 400 while the server keeps serving.

The folder gets a word-level tokenizer (token i is the word "w<i>", 0 is "<unk>"), so that text
and token ids correspond one to one and the log-probabilities can be indexed by id.
"""

import os
import re
import shlex
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "..", "docs", "vllm.md")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# what the test adds to the page's command: a small engine for a tiny model, the whole
# vocabulary's log-probabilities; and, unless asked for the compiled engine the page's command
# gives (torch.compile, a minute or two of warm-up on 2 cores), --enforce-eager
TEST_OPTIONS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-logprobs", "256",
                "--seed", "0"]


def write_tokenizer(folder, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(folder)


def documented_command():
    """The server command of docs/vllm.md, as a list of words with "$V/bin/python" and the
    checkpoint's path left as the page writes them."""
    with open(DOCS, encoding="utf-8") as f:
        lines = [line for line in f if f"-m {SERVER_MODULE}" in line and "$V/bin/python" in line]
    assert len(lines) == 1, f"docs/vllm.md: expected one server command, found {lines}"
    return shlex.split(lines[0].split("#", 1)[0], posix=True)


def server_command(folder, port):
    """(argv, environment assignments) of the page's command for `folder` on `port`."""
    words = documented_command()
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[:3] == ["$V/bin/python", "-m", SERVER_MODULE], words
    words[0] = sys.executable
    for option, value in (("--model", str(folder)), ("--port", str(port))):
        assert option in words, f"docs/vllm.md's server command has no {option}: {words}"
        words[words.index(option) + 1] = value
    return words + TEST_OPTIONS, env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, port, log_path, timeout):
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy after {timeout} s:\n{_tail(log_path)}")


def start_server(command_for, env, log_path, timeout, attempts=3):
    """Starts the server `command_for(port)` gives on a free port, its output to log_path, and
    waits until it is healthy: returns (process, port). Another process may bind the port
    between free_port() and the server (vLLM's engines open ephemeral ports of their own, and
    the suite runs two groups at once): the server then exits with "Address already in use",
    and is started again on a new port, up to `attempts` times. RuntimeError otherwise."""
    for attempt in range(attempts):
        port = free_port()
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(command_for(port), stdout=log, stderr=subprocess.STDOUT,
                                    env=env)
        try:
            wait_healthy(proc, port, log_path, timeout)
            return proc, port
        except RuntimeError:
            stop(proc)
            if attempt + 1 == attempts or "Address already in use" not in _tail(log_path):
                raise
    raise AssertionError("unreachable")


def with_options(argv, options):
    """argv with each option of `options` ({"--name": value}) set: its value replaced where
    argv has it, else appended."""
    argv = list(argv)
    for option, value in options.items():
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    return argv


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path, chars=6000):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-chars:]


def _token_id(key):
    match = re.fullmatch(r"token_id:(\d+)", key)
    assert match, f"expected 'token_id:<n>' keys (return_tokens_as_token_ids), got {key!r}"
    return int(match.group(1))


def serve_and_ask(folder, prompt, *, tokens, vocab, log_path, env=None, timeout=600,
                  eager=True):
    """Starts the server on `folder`, asks it, stops it. Returns (result, log) with result as
    vllm_run.py's {"tokens", "logprobs"} plus "text", "streamed_text", "hostile_status"; or
    {"error": ...} with the server's log when it does not come up."""
    import openai

    write_tokenizer(str(folder), vocab)

    def command_for(port):
        argv, _ = server_command(folder, port)
        return argv + (["--enforce-eager"] if eager else [])

    _, documented_env = server_command(folder, 0)
    # the page's settings, then a KV cache of 1 GiB (enough for the tiny models) and the test's
    full_env = {**os.environ, **documented_env, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    try:
        proc, port = start_server(command_for, full_env, log_path, timeout)
    except RuntimeError as e:
        return {"error": str(e)}, _tail(log_path, 200000)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=timeout, max_retries=0)
        model = client.models.list().data[0].id
        text = " ".join(f"w{t}" for t in prompt)
        common = dict(model=model, prompt=text, max_tokens=tokens, temperature=0.0,
                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        answer = client.completions.create(echo=True, logprobs=vocab, **common)
        choice = answer.choices[0]
        ids = [_token_id(t) for t in choice.logprobs.tokens]
        assert ids[:len(prompt)] == list(prompt), f"the server tokenized {text!r} as {ids}"
        steps = choice.logprobs.top_logprobs[1:len(prompt) + 1]  # position 0 has none
        logprobs = [[float("-inf")] * vocab for _ in steps]
        for row, step in zip(logprobs, steps):
            for key, value in step.items():
                row[_token_id(key)] = value
        plain = client.completions.create(**common).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in
                           client.completions.create(stream=True, **common) if chunk.choices)
        try:
            client.completions.create(model=model, prompt=text, max_tokens=100000)
            hostile = 200
        except openai.BadRequestError as e:
            hostile = e.status_code
        after = client.completions.create(**common).choices[0].text
        result = dict(tokens=ids[len(prompt):], logprobs=logprobs, text=plain,
                      streamed_text=streamed, hostile_status=hostile, text_after_hostile=after)
        return result, _tail(log_path, 200000)
    finally:
        stop(proc)
