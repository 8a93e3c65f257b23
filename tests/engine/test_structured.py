"""Structured output: grammar-constrained decoding (the protocols' format fields are
tested with their translation, in tests/server/test_translate.py)."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import pytest

from gmlx.engine import sampling
from gmlx.engine.structured import (
    GeneratedTokens,
    GrammarProcessor,
    compile_format,
    llg_tokenizer,
    make_grammar_processor,
)
from gmlx.engine.types import GenerateRequest, ResponseFormat, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "pos"],
    "additionalProperties": False,
}

STEPS = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
            "minItems": 1,
            "maxItems": 4,
        },
        "done": {"type": "boolean"},
    },
    "required": ["steps"],
    "additionalProperties": False,
}


def check(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """A small JSON Schema validator for the keywords these tests use."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), path
    elif kind is not None:
        assert isinstance(value, types[kind]), f"{path}: {value!r} is not {kind}"
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), f"{path}: too long"
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), path
        for i, item in enumerate(value):
            check(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                check(value[key], sub, f"{path}.{key}")


def generate(demo_model, processors: list[GrammarProcessor | None], seeds: list[int],
             max_tokens: int = 300) -> list[tuple[str, str]]:
    """Run one batch through mlx-lm's BatchGenerator (as the worker does); per row
    (text, finish_reason)."""
    from mlx_lm.generate import BatchGenerator

    tok = demo_model.tokenizer
    eos = sorted(tok.eos_token_ids)
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    gen = BatchGenerator(demo_model.model, stop_tokens=[[e] for e in eos],
                         completion_batch_size=len(seeds), prefill_batch_size=len(seeds))
    try:
        uids = gen.insert(
            [prompt] * len(seeds),
            max_tokens=[max_tokens] * len(seeds),
            samplers=[sampling.make_sampler(SamplingParams(temperature=1.0, seed=s)) for s in seeds],
            logits_processors=[[p] if p else [] for p in processors],
        )
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        while len(finish) < len(uids):
            for r in gen.next()[1]:
                tokens[r.uid].append(r.token)
                if r.finish_reason:
                    finish[r.uid] = r.finish_reason
    finally:
        gen.close()
    return [(tok.decode([t for t in tokens[u] if t not in eos]), finish[u]) for u in uids]


# -- the tokenizer cache ------------------------------------------------------------


def test_llg_tokenizer_is_built_once_per_tokenizer(demo_model):
    from gmlx.engine.loading import demo

    first = llg_tokenizer(demo_model.tokenizer)
    assert llg_tokenizer(demo_model.tokenizer) is first
    assert first.eos_tokens == sorted(demo_model.tokenizer.eos_token_ids)
    other = demo.load_tokenizer()  # an equal but distinct Tokenizer gets its own
    assert llg_tokenizer(other) is not first


# -- the processor, scripted --------------------------------------------------------


def allowed(logits: mx.array) -> set[int]:
    return {i for i, v in enumerate(logits.reshape(-1).tolist()) if v != float("-inf")}


def test_generated_tokens_marks_the_prompt_end_at_the_first_call():
    seen = GeneratedTokens()
    assert seen.update(mx.array([5, 6, 7])) == []
    assert seen.prompt_len == 3
    assert seen.update(mx.array([[5, 6, 7, 8]])) == [8]  # (1, n) works too
    assert seen.update(mx.array([5, 6, 7, 8, 9, 10])) == [9, 10]
    assert seen.update(mx.array([5, 6, 7, 8, 9, 10])) == []


def test_processor_follows_the_grammar_then_allows_only_eos(demo_model):
    tok = demo_model.tokenizer
    grammar = compile_format(ResponseFormat("json_schema", STEPS))
    proc = make_grammar_processor(tok, grammar)
    width = len(tok) + 10  # a model head wider than the vocabulary
    logits = mx.zeros((1, width))
    prompt = tok.encode("prompt", add_special_tokens=False)
    first = allowed(proc(mx.array(prompt), logits))
    assert first and all(tok.decode([t]).startswith("{") for t in first)
    assert not first & set(range(len(tok), width))
    context = list(prompt)
    for t in tok.encode('{"steps": [1, -2]', add_special_tokens=False):
        context.append(t)
        mask = allowed(proc(mx.array(context), logits))
    assert tok.token_to_id("}") in mask and tok.token_to_id("]") not in mask
    assert not mask & tok.eos_token_ids  # an open object cannot end
    context.append(tok.token_to_id("}"))
    assert allowed(proc(mx.array(context), logits)) == set(tok.eos_token_ids)
    assert proc.done
    # mlx-lm computes one step past EOS; the processor must not fail on it.
    context.append(min(tok.eos_token_ids))
    assert allowed(proc(mx.array(context), logits)) == set(tok.eos_token_ids)


def test_processor_that_sees_a_rejected_token_ends_the_request(demo_model):
    tok = demo_model.tokenizer
    proc = make_grammar_processor(tok, compile_format(ResponseFormat("json_object")))
    logits = mx.zeros((1, len(tok)))
    proc(mx.array([1, 2]), logits)
    bad = tok.encode("x", add_special_tokens=False)
    assert allowed(proc(mx.array([1, 2, *bad]), logits)) == set(tok.eos_token_ids)


def test_no_grammar_no_processor(demo_model):
    assert make_grammar_processor(demo_model.tokenizer, None) is None


# -- generation with the demo model ------------------------------------------------


@pytest.mark.parametrize("schema", [PERSON, STEPS], ids=["person", "steps"])
def test_every_sampled_output_validates(demo_model, schema):
    grammar = compile_format(ResponseFormat("json_schema", schema))
    seeds = [1, 2, 3, 4]
    # Constrained rows share the batch with unconstrained ones, each with its own state.
    procs = [make_grammar_processor(demo_model.tokenizer, grammar) if i % 2 == 0 else None
             for i in range(len(seeds) * 2)]
    rows = generate(demo_model, procs, seeds * 2)
    for (text, finish), proc in zip(rows, procs):
        if proc is None:
            continue
        assert finish == "stop", text
        check(json.loads(text), schema)
    free = [text for (text, _), proc in zip(rows, procs) if proc is None]
    assert not any(text.startswith("{") for text in free)  # the grammar did the work


def test_json_object_yields_objects(demo_model):
    grammar = compile_format(ResponseFormat("json_object"))
    seeds = [0, 1, 2, 3, 4, 5]
    rows = generate(demo_model, [make_grammar_processor(demo_model.tokenizer, grammar)
                                 for _ in seeds], seeds)
    finished = [text for text, finish in rows if finish == "stop"]
    assert len(finished) >= 2  # a random model writes long strings; some still close
    for text in finished:
        assert isinstance(json.loads(text), dict)
    assert all(text.startswith("{") for text, _ in rows)


def test_grammar_through_the_worker_with_prompt_cache(demo_model, monkeypatch):
    """The worker's path: processors built per request, prompt-cache hits included."""
    from gmlx.engine.worker import ModelWorker

    grammar = compile_format(ResponseFormat("json_schema", STEPS))
    base = sampling.make_processors
    monkeypatch.setattr(
        sampling, "make_processors",
        lambda params: [make_grammar_processor(demo_model.tokenizer, grammar), *base(params)],
    )
    worker = ModelWorker(demo_model, decode_batch=2)
    try:
        prompt = tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": "Count."}]))
        tiers = []
        for seed in (7, 7, 8):  # the repeats start from the cached prompt
            events = list(worker.generate(GenerateRequest(
                prompt, max_tokens=200, sampling=SamplingParams(temperature=1.0, seed=seed))))
            text = "".join(e.text for e in events)
            check(json.loads(text), STEPS)
            assert events[-1].finish_reason == "stop"
            tiers.append(events[-1].cache_tier)
        assert tiers[0] == "miss" and tiers[2] != "miss"
    finally:
        worker.close()
