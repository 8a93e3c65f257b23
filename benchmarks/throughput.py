"""Served throughput: ``gmlx serve`` against ``mlx_lm.server`` (the peer), in one run.

    python benchmarks/throughput.py                   # the tiny built-in demo model (hidden 128, 2 layers)
    python benchmarks/throughput.py --model small --tokens 96 --rounds 2
                                                      # a small random model (hidden 512, 4 layers)
    python benchmarks/throughput.py --model qwen1.5b --dtype bfloat16   # on an accelerator

The tiny model is where a server's own work shows: its decode step takes about a
millisecond, so scheduling, detokenizing and streaming are a large part of each token.
On a 2-core CPU the small model is bound by MLX's matrix kernels, the same for both
servers, and its ratios sit near 1.

Both servers run as subprocesses on free 127.0.0.1 ports, serving the same model folder
(so the same weights, tokenizer and chat template), and are driven by the same client
code: ``openai.AsyncOpenAI`` streaming chat completions, greedy (temperature 0), with a
``logit_bias`` of -100 on every end-of-sequence id (both servers honour ``logit_bias``,
so every stream runs to ``max_tokens``; the tokens actually produced are still taken
from each stream's ``usage`` and printed).

Width runs: ``width`` requests are sent at once, each with its own prompt of a fixed
token length (a unique tag first, so no prefix cache can help), for a fixed number
of output tokens. Measured per stream, on the client:
  - TTFT: request sent -> first chunk with non-empty ``content`` (gmlx sends an empty
    role chunk before the model has run; it does not count).
  - aggregate decode tok/s: tokens received after T0 / (T_end - T0), where T0 is when
    the last stream received its first token (from then on every stream is decoding)
    and T_end is when the last stream finished. Tokens received by T0 are counted as
    the content chunks received by then (each chunk is one token unless a token is an
    incomplete UTF-8 sequence; the "chunks" column checks that chunks == tokens).
The same definition serves both servers; the ratio column is gmlx / peer.

Prefix reuse: a ~2k-token system prompt shared by two requests. The first (a miss:
the prefix is new to the server) and the second (a hit: same system prompt, another
user message) are sent one after the other; TTFT miss / TTFT hit is each server's
speed-up. Repeated ``--prefix-reps`` times with a fresh prefix; medians are printed.

Rounds alternate between the two servers (round r: gmlx then the peer, round r+1 the
peer then gmlx), so slow drift of the machine's speed falls on both alike. The table
gives the median of each server's rounds, their ratio, and the range of the ratios of
neighbouring rounds (how far one pair of runs can stray on this machine).

Stall: a stream decodes; after its 16th token a prompt of ``--prefix`` tokens arrives.
Recorded: the stream's median gap between tokens before, its longest gap until the long
prompt's first token, how many tokens it got meanwhile, and the long prompt's TTFT. A
server that prefills in chunks between decode steps keeps the stream moving.

Each server gets one short warm-up request before anything is timed, and one untimed
round (8 output tokens) at each width before that width's timed rounds. Both servers
are killed at the end, also on error. Requests and server start-up are bounded by
timeouts; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

# A model big enough that a decode step is real matrix work on a CPU, small enough that
# a 2-core machine finishes the whole benchmark in minutes. The demo's tokenizer and
# chat template are reused, so prompts render identically on both servers.
SMALL_SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
# Qwen2.5-1.5B's shape, for an accelerator: decode steps of a few milliseconds, where a
# server's per-token overhead shows.
QWEN_1_5B_SHAPE = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "local", "model", "answers",
    "questions", "writes", "code", "calls", "tools", "agents", "run", "machine", "memory", "governor",
    "keeps", "server", "alive", "green", "yellow", "orange", "red", "bands", "weather", "Paris",
    "London", "Tokyo", "sunny", "warm", "hello", "world",
]
REQUEST_TIMEOUT_S = 300.0
START_TIMEOUT_S = 180.0


# -- the model -----------------------------------------------------------------------


def build_small_model(target: Path, shape: dict[str, int] = SMALL_SHAPE, dtype: str = "float32") -> Path:
    """A random qwen2 model of ``shape`` with the demo's tokenizer, in ``target``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from gmlx.engine.loading import demo
    from gmlx.engine.mlxlm import model_classes

    source = demo.ensure_built()
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, target / f.name)
    config = json.loads((source / "config.json").read_text())
    config.update(shape, torch_dtype=dtype)
    mx.random.seed(0)
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


class Prompts:
    """Chat messages of exact token lengths, rendered with the model's own template."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder))
        # Banned from the output (logit bias -100): every special token (end of sequence,
        # and the think and tool-call markers, which would send a random model's text into
        # reasoning or tool-call parsing), and every token that is not whole UTF-8 text on
        # its own, so that each generated token is exactly one streamed chunk on both
        # servers and chunks can be timed as tokens.
        special = {self.tok.convert_tokens_to_ids(t) for t in self.tok.all_special_tokens}
        special |= set(self.tok.added_tokens_encoder.values())
        partial = {i for i in range(len(self.tok)) if "\ufffd" in (t := self.tok.decode([i])) or not t}
        self.banned_ids = sorted(special | partial)

    def length(self, messages: list[dict[str, str]]) -> int:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, tag: str, n_tokens: int, role: str = "user") -> str:
        """Text starting with ``tag`` whose message renders to ``n_tokens`` prompt tokens
        (or the first length past it)."""
        words, i = [tag], 0
        while True:
            content = " ".join(words)
            missing = n_tokens - self.length([{"role": role, "content": content}])
            if missing <= 0:
                return content
            # Grow by about half the gap at a time: re-tokenizing 2k tokens per word is slow.
            for _ in range(max(1, missing // 2)):
                words.append(WORDS[(i * 7 + len(tag)) % len(WORDS)])
                i += 1


# -- the servers -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    model: str = ""
    proc: subprocess.Popen[bytes] | None = None
    # gmlx's readiness: ``/health?ready=1`` answers 503 until the model is loaded and
    # warmed up (a peer may not route a query string: mlx_lm.server answers 404)
    health: str = "/health"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("wb") as out:
            # A new session, so stopping it takes the whole process group with it.
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                r = httpx.get(f"{self.url}{self.health}", timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready in {START_TIMEOUT_S:.0f} s; see {self.log}")

    def status(self) -> str:
        if self.proc is None or self.proc.poll() is None:
            return "the server is still running"
        return f"the server exited with {self.proc.returncode}"

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def make_servers(folder: Path, workdir: Path, peer_args: list[str] | None = None) -> tuple[Server, Server]:
    # gmlx gets an empty home, so no user config file or cache takes part.
    home = workdir / "gmlx-home"
    home.mkdir()
    env = {**os.environ, "GMLX_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    gmlx = Server("gmlx", [sys.executable, "-m", "gmlx.cli.main", "serve", str(folder)], env,
                  workdir / "gmlx.log")
    gmlx.argv += ["--port", str(gmlx.port)]
    gmlx.health = "/health?ready=1"
    peer = Server("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(folder),
                                    "--log-level", "WARNING", *(peer_args or [])], env, workdir / "peer.log")
    peer.argv += ["--port", str(peer.port)]
    peer.model = "default_model"  # the peer's name for the model given with --model
    return gmlx, peer


# -- one streamed request -------------------------------------------------------------


@dataclass
class Stream:
    sent: float
    first: float | None = None  # first non-empty content chunk
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0  # from usage
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # the prompt tokens the server reports as reused

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent


def _delta_text(delta: Any) -> str:
    # gmlx and the peer may route text to a reasoning field (the peer calls it
    # `reasoning`, gmlx `reasoning_content`); any text the model produced counts.
    extra = delta.model_extra or {}
    return delta.content or extra.get("reasoning") or extra.get("reasoning_content") or ""


async def warm_sdk() -> None:
    """Pay the ``openai`` SDK's first streamed call here, against a fake transport: its
    first parse of a streamed chunk builds the SDK's type caches (~65 ms on a 2-core
    CPU, then ~6 ms a call), which would otherwise count in the first request's TTFT
    as if the server had spent it. The caches are per process, so any client gains."""
    import httpx

    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}]}
    body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

    def reply(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as http:
        client = openai.AsyncOpenAI(base_url="http://warm-up.invalid/v1", api_key="unused", http_client=http)
        await stream_chat(client, "m", [{"role": "user", "content": "x"}], 1, {"0": -100})


async def stream_chat(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]],
                      max_tokens: int, logit_bias: dict[str, int]) -> Stream:
    s = Stream(sent=time.perf_counter())
    response = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, logit_bias=logit_bias,
    )
    async for chunk in response:
        now = time.perf_counter()
        if chunk.choices and _delta_text(chunk.choices[0].delta):
            if s.first is None:
                s.first = now
            s.chunk_times.append(now)
        if chunk.usage is not None:
            s.tokens, s.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            if details := chunk.usage.prompt_tokens_details:
                s.cached_tokens = details.cached_tokens
    s.end = time.perf_counter()
    if s.first is None:
        raise RuntimeError("a stream produced no content")
    return s


# -- the measurements -----------------------------------------------------------------


@dataclass
class WidthResult:
    width: int
    rates: list[float] = field(default_factory=list)  # aggregate decode tok/s, one per round
    streams: list[Stream] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        return statistics.median(self.rates)

    def ttft(self, p: float) -> float:
        return percentile([s.ttft for s in self.streams], p)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def chunks(self) -> int:
        return sum(len(s.chunk_times) for s in self.streams)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def aggregate(streams: list[Stream]) -> float:
    """Tokens received after T0 (the last first token) / (T_end - T0); see the docstring."""
    t0 = max(s.first for s in streams if s.first is not None)
    t_end = max(s.end for s in streams)
    before = sum(sum(1 for t in s.chunk_times if t <= t0) for s in streams)
    return (sum(s.tokens for s in streams) - before) / (t_end - t0)


async def run_round(server: Server, client: openai.AsyncOpenAI, prompts: Prompts, width: int,
                    prompt_len: int, tokens: int, tag: str, bias: dict[str, int], into: WidthResult) -> None:
    """One round: ``width`` streams sent at once, each with a prompt of its own."""
    batch = [[{"role": "user", "content": prompts.text(f"{tag}s{i}{server.name[:4]}", prompt_len)}]
             for i in range(width)]
    try:
        streams = await asyncio.gather(*(stream_chat(client, server.model, m, tokens, bias) for m in batch))
    except Exception as e:
        raise RuntimeError(f"{server.name}, width {width}, round {tag}: {e!r} ({server.status()})") from e
    into.rates.append(aggregate(streams))
    into.streams += streams


@dataclass
class PrefixResult:
    misses: list[float] = field(default_factory=list)  # TTFT of each miss, seconds
    hits: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # reused on the hit, as the server reports it

    @property
    def miss(self) -> float:
        return statistics.median(self.misses)

    @property
    def hit(self) -> float:
        return statistics.median(self.hits)

    @property
    def speedup(self) -> float:
        return self.miss / self.hit


async def prefix_pair(server: Server, client: openai.AsyncOpenAI, prompts: Prompts, prefix_len: int,
                      tag: str, bias: dict[str, int], into: PrefixResult) -> None:
    """A miss (a system prompt new to the server), then a hit (the same system prompt,
    another question)."""
    system = {"role": "system", "content": prompts.text(f"prefix{tag}{server.name[:4]}", prefix_len, "system")}
    first = [system, {"role": "user", "content": "What is the weather like in Paris today?"}]
    second = [system, {"role": "user", "content": "Write a function that adds two numbers."}]
    miss = await stream_chat(client, server.model, first, 4, bias)
    hit = await stream_chat(client, server.model, second, 4, bias)
    into.misses.append(miss.ttft)
    into.hits.append(hit.ttft)
    into.prompt_tokens, into.cached_tokens = hit.prompt_tokens, hit.cached_tokens


@dataclass
class StallResult:
    """A stream decoding while a long prompt arrives: how long it waits between tokens."""

    before: list[float] = field(default_factory=list)  # its median gap before the long prompt
    longest: list[float] = field(default_factory=list)  # its longest gap until the long prompt's first token
    during: list[int] = field(default_factory=list)  # tokens it received meanwhile
    long_ttft: list[float] = field(default_factory=list)


async def stall_case(server: Server, client: openai.AsyncOpenAI, prompts: Prompts, prefix_len: int,
                     tag: str, bias: dict[str, int], into: StallResult) -> None:
    """A stream decodes; after its 16th token a ``prefix_len``-token prompt arrives. A
    server that prefills in chunks between decode steps keeps the stream moving."""
    times: list[float] = []
    sixteen = asyncio.Event()

    async def running() -> None:
        messages = [{"role": "user", "content": prompts.text(f"stall{tag}{server.name[:4]}", 32)}]
        response = await client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=256, temperature=0.0, stream=True,
            logit_bias=bias)
        async for chunk in response:
            if chunk.choices and _delta_text(chunk.choices[0].delta):
                times.append(time.perf_counter())
                if len(times) == 16:
                    sixteen.set()

    task = asyncio.create_task(running())
    await asyncio.wait_for(sixteen.wait(), REQUEST_TIMEOUT_S)
    sent = time.perf_counter()
    system = {"role": "system", "content": prompts.text(f"stallprefix{tag}{server.name[:4]}", prefix_len, "system")}
    long = await stream_chat(client, server.model, [system, {"role": "user", "content": "Summarize."}], 4, bias)
    await task
    assert long.first is not None
    gaps = list(itertools.pairwise(times))
    into.before.append(statistics.median(b - a for a, b in gaps[:15]))
    window = [(a, b) for a, b in gaps if b > sent and a < long.first]
    into.longest.append(max((b - a for a, b in window), default=long.first - sent))
    into.during.append(sum(1 for t in times if sent < t <= long.first))
    into.long_ttft.append(long.ttft)


def in_turn(servers: tuple[Server, Server], r: int) -> tuple[Server, Server]:
    """Round ``r``'s order: gmlx first in even rounds, the peer first in odd ones."""
    return servers if r % 2 == 0 else servers[::-1]


async def warm_up(server: Server, client: openai.AsyncOpenAI, bias: dict[str, int]) -> None:
    await stream_chat(client, server.model, [{"role": "user", "content": "Hello, world!"}], 8, bias)


# -- the run --------------------------------------------------------------------------


async def measure(args: argparse.Namespace, gmlx: Server, peer: Server, prompts: Prompts
                  ) -> tuple[dict[str, list[WidthResult]], dict[str, PrefixResult], dict[str, StallResult]]:
    bias = {str(i): -100 for i in prompts.banned_ids}
    servers = (gmlx, peer)
    clients = {s.name: openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0,
                                          timeout=REQUEST_TIMEOUT_S) for s in servers}
    try:
        if not gmlx.model:
            models = (await clients[gmlx.name].models.list()).data
            gmlx.model = models[0].id
        for s in servers:
            await warm_up(s, clients[s.name], bias)
        # Rounds alternate between the servers (and which goes first), so that slow drift
        # of the machine falls on both alike; each round's ratio pairs neighbouring runs.
        widths: dict[str, list[WidthResult]] = {s.name: [] for s in servers}
        for width in args.widths:
            results = {s.name: WidthResult(width) for s in servers}
            for s in servers:  # an untimed round first: each width's kernels compile on first use
                await run_round(s, clients[s.name], prompts, width, args.prompt, 8, f"w{width}warm", bias,
                                WidthResult(width))
            for r in range(args.rounds):
                for s in in_turn(servers, r):
                    await run_round(s, clients[s.name], prompts, width, args.prompt, args.tokens,
                                    f"w{width}r{r}", bias, results[s.name])
            for s in servers:
                widths[s.name].append(results[s.name])
                res = results[s.name]
                print(f"  {s.name:>14} width {width}: {res.decode_tok_s:.1f} tok/s "
                      f"(rounds {', '.join(f'{x:.0f}' for x in res.rates)}), "
                      f"TTFT p50 {res.ttft(0.5) * 1000:.0f} ms", flush=True)
        prefix = {s.name: PrefixResult() for s in servers}
        for r in range(args.prefix_reps):
            for s in in_turn(servers, r):
                await prefix_pair(s, clients[s.name], prompts, args.prefix, str(r), bias, prefix[s.name])
        for s in servers if args.prefix_reps > 0 else ():
            print(f"  {s.name:>14} prefix: miss {prefix[s.name].miss * 1000:.0f} ms, "
                  f"hit {prefix[s.name].hit * 1000:.0f} ms", flush=True)
        stall = {s.name: StallResult() for s in servers}
        for r in range(args.prefix_reps):
            for s in in_turn(servers, r):
                await stall_case(s, clients[s.name], prompts, args.prefix, str(r), bias, stall[s.name])
        return widths, prefix, stall
    finally:
        for c in clients.values():
            await c.close()


def report(args: argparse.Namespace, model_desc: str, gmlx: Server, peer: Server,
           widths: dict[str, list[WidthResult]], prefix: dict[str, PrefixResult],
           stall: dict[str, StallResult]) -> None:
    import mlx.core as mx

    print()
    print(f"model: {model_desc}; device: {mx.default_device()}; prompt {args.prompt} tokens, "
          f"output {args.tokens} tokens, rounds {args.rounds}, greedy, EOS biased -100")
    print("aggregate decode tok/s = tokens received after the last stream's first token / "
          "(last finish - last first token)")
    print()
    print("| width | peer tok/s | gmlx tok/s | ratio | round ratios | peer TTFT p50/p95 ms "
          "| gmlx TTFT p50/p95 ms | tokens peer/gmlx | chunks peer/gmlx |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for ours, theirs in zip(widths[gmlx.name], widths[peer.name]):
        paired = sorted(a / b for a, b in zip(ours.rates, theirs.rates))
        print(f"| {ours.width} | {theirs.decode_tok_s:.1f} | {ours.decode_tok_s:.1f} | "
              f"{ours.decode_tok_s / theirs.decode_tok_s:.2f} | {paired[0]:.2f}–{paired[-1]:.2f} | "
              f"{theirs.ttft(0.5) * 1000:.0f} / {theirs.ttft(0.95) * 1000:.0f} | "
              f"{ours.ttft(0.5) * 1000:.0f} / {ours.ttft(0.95) * 1000:.0f} | "
              f"{theirs.tokens} / {ours.tokens} | {theirs.chunks} / {ours.chunks} |")
    if args.prefix_reps <= 0:  # the prefix-reuse and stall cases were skipped
        return
    p = prefix
    print_table(
        f"prefix reuse ({p[gmlx.name].prompt_tokens} prompt tokens, ~{args.prefix}-token shared system "
        f"prompt, median of {args.prefix_reps}):",
        ["server", "TTFT miss ms", "TTFT hit ms", "speed-up (miss / hit)", "cached tokens on the hit"],
        [[s.name, f"{p[s.name].miss * 1000:.0f}", f"{p[s.name].hit * 1000:.0f}", f"{p[s.name].speedup:.1f}x",
          str(p[s.name].cached_tokens)] for s in (peer, gmlx)],
    )
    med = statistics.median
    print_table(
        f"a decoding stream while a {p[gmlx.name].prompt_tokens}-token prompt arrives after its 16th token "
        f"(median of {args.prefix_reps}):",
        ["server", "its gap before ms", "its longest gap ms", "its tokens meanwhile", "long prompt TTFT ms"],
        [[s.name, f"{med(st.before) * 1000:.1f}", f"{med(st.longest) * 1000:.0f}", f"{med(st.during):.0f}",
          f"{med(st.long_ttft) * 1000:.0f}"] for s, st in ((peer, stall[peer.name]), (gmlx, stall[gmlx.name]))],
    )


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A markdown table under a title line: the first column left-aligned, the rest right."""
    print()
    print(title)
    print()
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("small", "demo", "qwen1.5b"), default="demo",
                        help="small: random qwen2, hidden 512, 4 layers, demo tokenizer; demo: the built-in "
                             "model; qwen1.5b: random weights of Qwen2.5-1.5B's shape (for an accelerator)")
    parser.add_argument("--dtype", default="float32", help="weights dtype of the random models")
    parser.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--prompt", type=int, default=96, help="prompt tokens per request (width runs)")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per width; the median rate is kept")
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens (prefix-reuse case)")
    parser.add_argument("--prefix-reps", type=int, default=3)
    parser.add_argument("--peer-args", type=shlex.split, default=[],
                        help="extra mlx_lm.server flags, for experiments (e.g. '--prefill-step-size 512')")
    parser.add_argument("--keep-logs", action="store_true", help="print where the server logs are and keep them")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gmlx-bench-"))
    gmlx = peer = None
    try:
        if args.model in ("small", "qwen1.5b"):
            dims = SMALL_SHAPE if args.model == "small" else QWEN_1_5B_SHAPE
            folder = build_small_model(workdir / "model", dims, args.dtype)
            shape = ", ".join(f"{k.removesuffix('_size').removeprefix('num_')} {v}" for k, v in dims.items())
            model_desc = f"random qwen2 ({shape}), demo tokenizer, {args.dtype}"
        else:
            from gmlx.engine.loading import demo

            folder = demo.ensure_built()
            model_desc = "gmlx demo (random qwen2, hidden 128, 2 layers), float32"
        prompts = Prompts(folder)
        gmlx, peer = make_servers(folder, workdir, args.peer_args)
        for s in (gmlx, peer):
            s.start()
        for s in (gmlx, peer):
            s.wait_ready()
        started = time.perf_counter()
        try:
            widths, prefix, stall = asyncio.run(measure(args, gmlx, peer, prompts))
        except Exception:
            for s in (gmlx, peer):  # what each server said, before its log is removed
                print(f"--- {s.name} ({s.status()}), last lines of its log:\n{s.tail()}", file=sys.stderr)
            raise
        report(args, model_desc, gmlx, peer, widths, prefix, stall)
        print(f"\nmeasured in {time.perf_counter() - started:.0f} s")
    finally:
        for s in (gmlx, peer):
            if s is not None:
                s.stop()
        if args.keep_logs:
            print(f"server logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
