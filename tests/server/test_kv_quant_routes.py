"""KV-cache quantization through a real server: the ``/v1/models`` fields, the capacity
plan priced at the quantized width, and greedy answers equal batched and alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from live_server import LiveServer, serve_config

from gmlx.engine import capacity
from gmlx.engine.kv_quant import KVQuant

KV_QUANT = "{scheme: uniform, bits: 8, group_size: 32}"
CONFIG = f"""server:
  decode_batch: 4
  prompt_cache_bytes: 0
models:
  quant:
    source: demo
    pinned: true
    kv_quant: {KV_QUANT}
  tail:
    source: demo
    kv_quant: {{scheme: kvarn, bits: 4, group_size: 32, value_bits: 2, tail_tokens: 16}}
  plain:
    source: demo
    pinned: true
  drafting:
    source: demo
    prompt_lookup: true
    kv_quant: {KV_QUANT}
  drafting_late:
    source: demo
    prompt_lookup: true
    kv_quant: {{scheme: uniform, bits: 4, group_size: 32, start: 64}}
"""


class Budget:
    """The free memory the servers see: fixed, so their capacity tables are comparable."""

    value = 200 * 1024**2

    def __call__(self) -> int:
        return self.value


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    live = serve_config(tmp_path_factory.mktemp("kvq"), CONFIG, models=())
    yield live
    live.stop()


def _models(live: LiveServer) -> dict[str, dict]:
    with httpx.Client(base_url=live.url, timeout=30) as http:
        return {m["id"]: m for m in http.get("/v1/models").json()["data"]}


def test_models_list_the_kv_quant_object_and_kv_bytes_per_token(server):
    models = _models(server)
    quant, plain, tail = models["quant"], models["plain"], models["tail"]
    assert quant["kv_quant"] == {"scheme": "uniform", "bits": 8, "group_size": 32, "start": 0,
                                 "layers_quantized": 2, "layers_fp16": 0, "verdict": "full",
                                 "verdict_batched": "full"}
    # float32 heads of 32, 2 kv heads, 2 layers: 40 bytes a head at 8 bits, 128 in full
    assert quant["kv_bytes_per_token"] == 2 * 2 * 2 * 40
    assert plain["kv_bytes_per_token"] == 2 * 2 * 2 * 128 and plain["kv_quant"] is None
    assert tail["resident"] is False and tail["kv_bytes_per_token"] is None and tail["kv_quant"] is None


def test_a_resident_kvarn_model_lists_its_tail(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60)
    client.completions.create(model="tail", prompt="hello", max_tokens=2, temperature=0)
    tail = _models(server)["tail"]
    assert tail["kv_quant"]["scheme"] == "kvarn"
    assert (tail["kv_quant"]["value_bits"], tail["kv_quant"]["tail_tokens"]) == (2, 16)
    assert tail["kv_bytes_per_token"] == 2 * 2 * (24 + 16)  # keys at 4 bits, values at 2


def test_greedy_answers_are_the_same_batched_and_alone(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60)
    prompts = [f"tell me about {w} " * (1 + i * 7) for i, w in enumerate(("cats", "rivers", "tea", "maps"))]

    def ask(prompt: str) -> str:
        r = client.completions.create(model="quant", prompt=prompt, max_tokens=20, temperature=0)
        return r.choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_a_speculative_model_quantizes_its_kv_where_rounds_can_be_trimmed(server):
    """Verification drops each stream's rejected drafts from its KV: a scheme from
    position 0 can (the drafting model answers as the quantized model does, lists every
    layer quantized and is priced so); one with a start offset cannot, so that drafting
    model runs full-precision KV, lists it as dropped and answers as the plain model."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60)

    def ask(model: str) -> str:
        r = client.completions.create(model=model, prompt="count: one two three one two",
                                      max_tokens=16, temperature=0)
        return r.choices[0].text

    assert ask("drafting") == ask("quant")
    models = _models(server)
    drafting = models["drafting"]
    assert drafting["speculative"] is True
    assert drafting["kv_quant"]["verdict"] == drafting["kv_quant"]["verdict_batched"] == "full"
    assert drafting["kv_quant"]["layers_fp16"] == 0
    assert drafting["kv_bytes_per_token"] == models["quant"]["kv_bytes_per_token"] < 2 * 2 * 2 * 128

    assert ask("drafting_late") == ask("plain")
    tail = _models(server)["drafting_late"]
    assert tail["speculative"] is True
    assert tail["kv_quant"]["verdict"] == tail["kv_quant"]["verdict_batched"] == "dropped"
    assert tail["kv_quant"]["layers_quantized"] == 0
    assert tail["kv_bytes_per_token"] == 2 * 2 * 2 * 128  # priced at full precision


def _plan(tmp_path, yaml_text: str, width: int, depth: int) -> dict:
    tmp_path.mkdir()
    live = serve_config(tmp_path, yaml_text, models=(), probe=Budget())
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            plan = http.get("/v1/capacity/plan", params={"width": width, "depth": depth}).json()
        table = live.app.state.registry.capacity
        return {**plan, "budget": table.budget_bytes, "chunk": table.chunk}
    finally:
        live.stop()


def test_the_capacity_plan_grows_by_the_quantized_factor(tmp_path, demo_model):
    """Same memory, same model: each context token costs WIDTH x the KV per token plus
    the prefill chunk's attention scores against it (CPU: no fused attention); 8-bit
    KV lowers the first term by 128/40, and the plan's max context grows by the ratio."""
    from gmlx.engine.scheduling import default_prefill_step

    head = ("server:\n  decode_batch: 8\n  prompt_cache_bytes: 0\n  governor_floor_bytes: 1024\n"
            "models:\n  m:\n    source: demo\n    pinned: true\n")
    width, depth = 64, 4096
    full = _plan(tmp_path / "full", head, width, depth)
    quant = _plan(tmp_path / "quant", head + f"    kv_quant: {KV_QUANT}\n", width, depth)
    assert full["ok"] is False and quant["ok"] is True
    fp_geom = capacity.probe_geometry(demo_model)
    q_geom = capacity.probe_geometry(demo_model, KVQuant("uniform", 8, 32))
    scores = fp_geom.n_heads * default_prefill_step() * fp_geom.dtype_bytes * 11 / 10
    factor = (width * fp_geom.kv_bytes_per_token + scores) / (width * q_geom.kv_bytes_per_token + scores)
    # the tables are the engine's, for the budget both servers measured
    assert full["budget"] == quant["budget"]
    assert full["max_ctx"] == capacity.max_context(fp_geom, width, full["budget"], full["chunk"])
    assert quant["max_ctx"] == capacity.max_context(q_geom, width, quant["budget"], quant["chunk"])
    # ...and the context grows by the factor, to within the KV's 256-token steps
    assert quant["max_ctx"] / full["max_ctx"] == pytest.approx(factor, rel=0.25)


# -- the CLI ----------------------------------------------------------------------------------


def _gmlx(*args: str):
    from typer.testing import CliRunner

    from gmlx.cli.main import app

    return CliRunner().invoke(app, list(args))


def test_plan_kv_bits_prints_the_fit_both_ways():
    r = _gmlx("plan", "--width", "8", "--depth", "4000", "demo", "--kv-bits", "8", "--kv-group-size", "32", "--json")
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    quant = body["with_kv_quant"]
    assert (quant["kv_bits"], quant["kv_group_size"]) == (8, 32)
    assert body["kv_bytes_per_token"] / quant["kv_bytes_per_token"] == 128 / 40
    assert quant["budget_bytes"] == body["budget_bytes"]  # the same memory, priced both ways
    text = _gmlx("plan", "-w", "8", "-d", "4000", "demo", "--kv-bits", "4", "--kv-group-size", "32")
    assert text.exit_code == 0 and "with --kv-bits 4: fits" in text.stdout
    assert "no layer's KV quantizes" not in text.stdout
    dropped = _gmlx("plan", "-w", "8", "-d", "4000", "demo", "--kv-bits", "8")  # group 64: the demo's heads are 32
    assert dropped.exit_code == 0 and "no layer's KV quantizes at group 64" in " ".join(dropped.stdout.split())
    bad = _gmlx("plan", "-w", "8", "-d", "4000", "demo", "--kv-bits", "7")
    assert bad.exit_code == 2 and "cannot be packed" in bad.stderr


def test_run_kv_bits_answers_with_a_quantized_cache():
    same = _gmlx("run", "demo", "-p", "hello there", "-n", "12", "-t", "0", "--kv-bits", "8", "--kv-group-size", "32")
    plain = _gmlx("run", "demo", "-p", "hello there", "-n", "12", "-t", "0")
    assert same.exit_code == 0 and plain.exit_code == 0, same.output
    assert same.stdout == plain.stdout  # 8-bit KV leaves this greedy answer as it was
