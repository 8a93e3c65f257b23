"""Soak: ``gmlx serve`` under mixed and hostile load for N minutes, then drained.

    python benchmarks/soak.py                     # 10 minutes against a demo server it starts
    python benchmarks/soak.py --minutes 1
    python benchmarks/soak.py --url http://127.0.0.1:8080   # a running server on this machine

The server it starts serves ``demo`` with decode width 4, queue cap 8, a 2 MiB prompt-cache
bound (a cache filling to its bound is not a leak), 1 MiB body and 64-message limits.

Twice the queue cap of clients send requests back to back: OpenAI chat, completions and
Responses and Anthropic messages, through the ``openai`` / ``anthropic`` SDKs or raw httpx,
streamed or not, some structured (a JSON schema) or with tools, half behind one of 16 shared
system prompts (cache hits and evictions). 20% leave at a random point (a stream closed after
a few events, a whole answer abandoned after a random delay); 15% send a bad body (truncated
JSON, wrong types, an unknown model, too many stop strings or messages, an oversized body...).
One task cancels random listed requests (``/v1/requests/{id}``), another samples the server's
RSS every second.

Each answer is: completed (2xx, or a stream that ended with a finish), a deliberate disconnect,
a typed refusal (a non-2xx or an error event in the protocol's error shape, by status and
type), or a failure: untyped (a non-2xx not in that shape, a stream ending without a finish or
an error event, a connection error, no answer in time) or a 5xx other than a typed 503.
TTFT: sent -> first streamed text. RSS growth: median over the run's last tenth against median
over the tenth after its middle. Then ``/v1/metrics`` is read until nothing is listed (at most
``DRAIN_TIMEOUT_S``). Exit status 1 when a target is missed: no failures, growth < 5%, nothing
listed after the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil
from soak_bodies import MAX_BODY_BYTES, MAX_MESSAGES, bad_body, error_type, stream_event, valid_body
from throughput import Server, percentile, print_table

DECODE_BATCH, QUEUE_CAP, PROMPT_CACHE_BYTES = 4, 8, 2 << 20
REQUEST_TIMEOUT_S, DRAIN_TIMEOUT_S = 180.0, 120.0
DISCONNECT_P, BAD_P, GROWTH_TARGET = 0.20, 0.15, 0.05
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "messages": "/v1/messages"}


# -- what comes back -----------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    bad_sent: int = 0
    bad_accepted: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    cancels: Counter[str] = field(default_factory=Counter)
    untyped: int = 0
    server_5xx: int = 0
    ttft: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def fail(self, what: str, untyped: bool = True) -> None:
        self.untyped, self.server_5xx = self.untyped + untyped, self.server_5xx + (not untyped)
        if len(self.examples) < 20:
            self.examples.append(what[:300])

    def refused(self, status: int, body: Any, anthropic_shape: bool, where: str) -> None:
        kind = error_type(body, anthropic_shape)
        if kind is None:
            self.fail(f"{where}: untyped {status}: {body!r}")
        elif status >= 500 and status != 503:
            self.fail(f"{where}: {status} {kind}: {body!r}", untyped=False)
        else:
            self.refusals[f"{status} {kind}"] += 1

    def streamed(self, kind: str, seen: set[str], error: dict[str, Any] | None, where: str) -> None:
        if error is not None:
            if kind == "responses":  # its own error event: {"type": "error", "code", "message"...}
                name = str(error.get("code") or "error") if isinstance(error.get("message"), str) else None
            else:
                name = error_type(error, kind == "messages")
            if name is None:
                self.fail(f"{where}: untyped stream error: {error!r}")
            else:
                self.refusals[f"stream {name}"] += 1
        elif "finish" in seen:
            self.completed += 1
        else:
            self.fail(f"{where}: the stream ended without a finish or an error event")


def body_of(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:200]


# -- the clients -----------------------------------------------------------------------------


@dataclass
class Soak:
    url: str
    model: str
    deadline: float
    tally: Tally
    http: httpx.AsyncClient
    oai: openai.AsyncOpenAI
    ant: anthropic.AsyncAnthropic

    async def raw(self, kind: str, content: bytes, leave_at: int | None, bad: str = "") -> None:
        """One request over raw httpx; ``bad``: what is wrong with a body that must be refused."""
        sent, headers = time.perf_counter(), {"content-type": "application/json", "x-api-key": "soak"}
        if kind == "messages":
            headers["anthropic-version"] = "2023-06-01"
        async with self.http.stream("POST", self.url + ROUTES[kind], content=content, headers=headers) as r:
            if r.status_code >= 300:
                await r.aread()
                return self.tally.refused(r.status_code, body_of(r), kind == "messages", f"raw {kind}")
            if bad:
                self.tally.bad_accepted[f"{kind}: {bad}"] += 1
            if "text/event-stream" not in r.headers.get("content-type", ""):
                await r.aread()
                self.tally.completed += 1
                return
            frames = (json.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]")
            await self.read(kind, frames, sent, leave_at, f"raw {kind}")

    async def sdk(self, kind: str, body: dict[str, Any], leave_at: int | None) -> None:
        """One request through the protocol's SDK; a stream's events are read as JSON."""
        t, where, sent = self.tally, f"sdk {kind}", time.perf_counter()
        create = {"chat": self.oai.chat.completions.create, "completions": self.oai.completions.create,
                  "responses": self.oai.responses.create, "messages": self.ant.messages.create}[kind]
        try:
            answer = await create(**body)
            if not body["stream"]:
                t.completed += 1
                return
            async with answer as events:
                await self.read(kind, (ev.model_dump() async for ev in events), sent, leave_at, where)
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            if e.status_code < 300:  # an error event in an Anthropic stream
                t.streamed(kind, set(), e.body if isinstance(e.body, dict) else {}, where)
            else:
                t.refused(e.status_code, body_of(e.response), kind == "messages", where)
        except (openai.APIConnectionError, anthropic.APIConnectionError) as e:
            t.fail(f"{where}: {type(e).__name__}: {e} ({e.__cause__!r})")
        except openai.APIError as e:  # an error object in an OpenAI stream (its inner part)
            t.streamed(kind, set(), {"error": e.body}, where)

    async def read(self, kind: str, events: AsyncIterator[dict[str, Any]], sent: float,
                   leave_at: int | None, where: str) -> None:
        """Read a stream's JSON events to its end, or leave after ``leave_at`` of them."""
        seen: set[str] = set()
        error: dict[str, Any] | None = None
        n = 0
        async for data in events:
            n += 1
            if leave_at is not None and n >= leave_at:
                self.tally.disconnected += 1
                return
            what = stream_event(kind, data)
            if what == "text" and "text" not in seen:
                self.tally.ttft.append(time.perf_counter() - sent)
            if what == "error" and error is None:
                error = data
            seen.add(what or "")
        self.tally.streamed(kind, seen, error, where)

    async def one(self, rng: random.Random) -> None:
        """One request of a random kind, way and fate."""
        kind, wrong = rng.choice(list(ROUTES)), ""
        stream, leave = rng.random() < 0.6, rng.random() < DISCONNECT_P
        self.tally.sent += 1
        leave_at = rng.randint(1, 24) if leave and stream else None
        if rng.random() < BAD_P:
            self.tally.bad_sent += 1
            wrong, content = bad_body(kind, self.model, rng)
            job = self.raw(kind, content, None, bad=wrong)
        elif rng.random() < 0.3:
            job = self.raw(kind, json.dumps(valid_body(kind, self.model, rng, stream)).encode(), leave_at)
        else:
            job = self.sdk(kind, valid_body(kind, self.model, rng, stream), leave_at)
        limit = rng.uniform(0.05, 2.0) if leave and not stream else REQUEST_TIMEOUT_S
        try:
            await asyncio.wait_for(job, limit)
        except TimeoutError:
            if limit == REQUEST_TIMEOUT_S:
                self.tally.fail(f"{kind}: no answer within {REQUEST_TIMEOUT_S:.0f} s")
            else:
                self.tally.disconnected += 1
        except Exception as e:  # noqa: BLE001 - a connection error, a frame not JSON...: recorded
            self.tally.fail(f"{kind} {wrong}: {type(e).__name__}: {e}")

    async def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            refused = sum(self.tally.refusals.values())
            await self.one(rng)
            if sum(self.tally.refusals.values()) > refused:  # back off a little after a refusal
                await asyncio.sleep(rng.uniform(0.05, 0.5))

    async def canceller(self, rng: random.Random) -> None:
        """Cancel a random listed request every second or so, either route."""
        while time.monotonic() < self.deadline:
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            try:
                rows = (await self.metrics())["requests"]
                if not rows:
                    continue
                rid = rng.choice(rows)["id"]
                if rng.random() < 0.5:
                    r = await self.http.post(f"{self.url}/v1/requests/{rid}/cancel")
                else:
                    r = await self.http.delete(f"{self.url}/v1/requests/{rid}")
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.tally.fail(f"cancel: {type(e).__name__}: {e}")
                continue
            if r.status_code == 200:
                self.tally.cancels["200"] += 1
            elif (name := error_type(body_of(r), False)) is not None and r.status_code < 500:
                self.tally.cancels[f"{r.status_code} {name}"] += 1
            else:
                self.tally.fail(f"cancel: untyped {r.status_code}: {body_of(r)!r}")

    async def metrics(self) -> dict[str, Any]:
        r = await self.http.get(f"{self.url}/v1/metrics", timeout=30.0)
        r.raise_for_status()
        return r.json()["server"]


async def sample_rss(pid: int, until: asyncio.Event, into: list[tuple[float, int]]) -> None:
    """The server's RSS every second (nothing when it is not a process of this machine)."""
    with contextlib.suppress(psutil.Error):  # gone: the clients' failures say so
        proc = psutil.Process(pid)
        while not until.is_set():
            into.append((time.monotonic(), proc.memory_info().rss))
            await asyncio.sleep(1.0)


def growth(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Median RSS of the run's last tenth over the median of the tenth after its middle, - 1."""
    span = end - start

    def window(lo: float, hi: float) -> float:
        vals = [rss for t, rss in samples if start + lo * span <= t <= start + hi * span]
        return statistics.median(vals) if vals else float("nan")

    return window(0.9, 1.0) / window(0.5, 0.6) - 1


# -- the run ---------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, url: str) -> bool:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        snap = (await http.get(f"{url}/v1/metrics")).json()["server"]
        model = args.model or (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        clients = args.clients or 2 * snap["queue"]["cap"]
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="soak", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        ant = anthropic.AsyncAnthropic(base_url=url, api_key="soak", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        started = time.monotonic()
        s = Soak(url, model, started + args.minutes * 60, Tally(), http, oai, ant)
        samples: list[tuple[float, int]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(snap["pid"], stop, samples))
        print(f"soak: {clients} clients on {model} at {url} for {args.minutes:g} min "
              f"(queue cap {snap['queue']['cap']}, decode batch {snap['concurrency']['decode_batch']})",
              file=sys.stderr)
        await asyncio.gather(*(s.client(args.seed * 1000 + i) for i in range(clients)),
                             s.canceller(random.Random(args.seed)))
        ended = time.monotonic()
        stop.set()
        await sampler
        drain_deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            snap = await s.metrics()  # requests listed; slots held (in flight + waiting)
            held = sum(m["in_flight"] + m["waiting"] for m in snap["resident_models"])
            left = len(snap["requests"]), max(held, snap["queue"]["waiting"], snap["concurrency"]["in_flight"])
            if left == (0, 0) or time.monotonic() > drain_deadline:
                break
            await asyncio.sleep(0.5)
        drained_s = time.monotonic() - ended
        await oai.close()
        await ant.close()
    return report(args, s.tally, clients, samples, started, ended, left, drained_s, snap)


def report(args: argparse.Namespace, t: Tally, clients: int, samples: list[tuple[float, int]],
           started: float, ended: float, left: tuple[int, int], drained_s: float,
           snap: dict[str, Any]) -> bool:
    mib = 1 << 20
    rss = [r for _, r in samples]
    grew = growth(samples, started, ended) if len(samples) > 20 else 0.0  # unmeasured: not a miss
    ttft = sorted(t.ttft)
    cache = sum(m.get("prompt_cache_bytes") or 0 for m in snap["resident_models"])
    ok = {"failures": t.untyped == 0 and t.server_5xx == 0, "growth": grew < GROWTH_TARGET,
          "drain": left == (0, 0)}
    mark = {True: "ok", False: "MISSED"}
    rows = [
        ["clients (2 x queue cap), minutes", f"{clients}, {args.minutes:g}", ""],
        ["sent", str(t.sent), ""],
        ["completed (2xx, or a stream that finished)", str(t.completed), ""],
        ["client disconnects (deliberate)", str(t.disconnected), ""],
        ["bad bodies sent / accepted (2xx)", f"{t.bad_sent} / {sum(t.bad_accepted.values())}", ""],
        *[[f"typed refusal: {k}", str(v), ""] for k, v in sorted(t.refusals.items())],
        ["admin cancels: " + ", ".join(f"{k}: {v}" for k, v in sorted(t.cancels.items())),
         str(sum(t.cancels.values())), ""],
        ["untyped errors", str(t.untyped), f"0 {mark[t.untyped == 0]}"],
        ["5xx other than typed 503", str(t.server_5xx), f"0 {mark[t.server_5xx == 0]}"],
        ["TTFT p50 / p95 ms", f"{percentile(ttft, 0.5) * 1000:.0f} / {percentile(ttft, 0.95) * 1000:.0f}"
         if ttft else "-", ""],
        ["server RSS first / peak / last MiB", f"{rss[0] / mib:.0f} / {max(rss) / mib:.0f} / "
         f"{rss[-1] / mib:.0f}" if rss else "-", ""],
        ["RSS growth across the second half", f"{grew * 100:+.1f}%", f"< 5% {mark[ok['growth']]}"],
        ["prompt cache after the run KiB (bound)", f"{cache >> 10} ({args.prompt_cache_bytes >> 10})", ""],
        [f"requests / slots listed after the drain ({drained_s:.0f} s)", f"{left[0]} / {left[1]}",
         f"0 {mark[ok['drain']]}"],
    ]
    print_table(f"Soak, {args.minutes:g} minutes", ["measure", "value", "target"], rows)
    for example in t.examples:
        print(f"  failure: {example}")
    if t.bad_accepted:
        print(f"  bad bodies accepted: {dict(t.bad_accepted)}")
    return all(ok.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--url", help="a running server to drive instead of starting one")
    parser.add_argument("--model", help="the model to request (default: the first of /v1/models)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default: 2 x the queue cap)")
    parser.add_argument("--prompt-cache-bytes", type=int, default=PROMPT_CACHE_BYTES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.url:
        sys.exit(0 if asyncio.run(soak(args, args.url.rstrip("/"))) else 1)
    with tempfile.TemporaryDirectory(prefix="gmlx-soak-") as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        config = work / "gmlx.yaml"
        config.write_text(json.dumps({"server": {  # JSON is YAML
            "decode_batch": DECODE_BATCH, "queue_depth_cap": QUEUE_CAP,
            "prompt_cache_bytes": args.prompt_cache_bytes, "max_body_bytes": MAX_BODY_BYTES,
            "max_messages": MAX_MESSAGES}}))
        env = {**os.environ, "GMLX_HOME": str(work / "home"), "PYTHONUNBUFFERED": "1"}
        server = Server("gmlx", [sys.executable, "-m", "gmlx.cli.main", "serve", "demo",
                                 "--config", str(config)], env, work / "gmlx.log")
        server.argv += ["--port", str(server.port)]
        server.health = "/health?ready=1"
        passed = False
        try:
            server.start()
            server.wait_ready()
            passed = asyncio.run(soak(args, server.url))
        finally:
            if not passed:
                print(f"--- gmlx ({server.status()}), last lines of its log:\n{server.tail()}", file=sys.stderr)
            server.stop()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
