"""Reasoning: markers, the streaming splitter, the thinking budget, template variables."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest

from gmlx.engine import sampling
from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.reasoning import (
    ReasoningSplitter,
    ThinkingBudgetProcessor,
    detect_open_think,
    make_thinking_budget_processor,
    template_kwargs,
    thinking_markers,
)
from gmlx.engine.types import SamplingParams


def split(chunks: list[str], **kwargs: Any) -> tuple[str, str]:
    splitter = ReasoningSplitter(**kwargs)
    reasoning = content = ""
    for chunk in [*chunks, None]:
        r, c = splitter.finish() if chunk is None else splitter.feed(chunk)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def chunkings(text: str) -> list[list[str]]:
    out = [[text], list(text)]
    out += [[text[i : i + s] for i in range(0, len(text), s)] for s in (2, 3, 4)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    return out


# -- markers ----------------------------------------------------------------------


def fake_tokenizer(tokens: set[str], template: str = "") -> Any:
    return SimpleNamespace(chat_template=template,
                           token_to_id=lambda t: 7 if t in tokens else None)


def test_markers_from_the_vocabulary(demo_model):
    assert thinking_markers(demo_model.tokenizer) == ("<think>", "</think>")
    assert thinking_markers(fake_tokenizer({"<|channel>", "<channel|>"})) == (
        "<|channel>thought", "<channel|>")
    assert thinking_markers(fake_tokenizer({"[THINK]", "[/THINK]"})) == ("[THINK]", "[/THINK]")


def test_markers_from_the_template_or_none():
    assert thinking_markers(fake_tokenizer(set(), "{{ '<think>' }}...{{ '</think>' }}")) == (
        "<think>", "</think>")
    assert thinking_markers(fake_tokenizer({"<think>"})) is None  # half a pair is not one
    assert thinking_markers(fake_tokenizer(set(), "plain")) is None


def test_detect_open_think():
    assert detect_open_think("<|im_start|>assistant\n<think>\n", "<think>")
    assert not detect_open_think("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>")
    assert not detect_open_think("<|im_start|>assistant\n", "<think>")


# -- splitting --------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", ("Let me see.", "The answer is 4.")),
    ("No thinking here.", ("", "No thinking here.")),
    ("<think></think>Short.", ("", "Short.")),
    ("Pre <think>a</think> mid <think>b</think> end", ("ab", "Pre  mid  end")),
    ("<think>unfinished thought", ("unfinished thought", "")),
    ("a </think> is just text outside", ("", "a </think> is just text outside")),
    ("x < y and <thi", ("", "x < y and <thi")),
])
def test_split_at_every_chunking(text, expected):
    for chunks in chunkings(text):
        assert split(chunks) == expected, chunks


def test_starts_inside():
    for chunks in chunkings("\nplanning...\n</think>\n\nDone.\n"):
        assert split(chunks, starts_inside=True) == ("planning...", "Done.\n")
    assert split(["Answer: <think> x </think>\n 42"]) == ("x", "Answer: \n 42")


def test_markers_are_held_until_clear():
    splitter = ReasoningSplitter()
    assert splitter.feed("Hi <th") == ("", "Hi ")  # "<th" might open a block: held
    assert splitter.feed("ink>deep") == ("deep", "")
    assert splitter.feed(" thought </thi") == (" thought", "")  # " " waits: it may frame
    assert splitter.inside
    assert splitter.feed("nk>ok") == ("", "ok")
    assert not splitter.inside


def test_other_markers():
    assert split(["<|channel>thought\nhmm<channel|>Yes."], start="<|channel>thought",
                 end="<channel|>") == ("hmm", "Yes.")


# -- the budget, scripted ---------------------------------------------------------


def allowed(logits: mx.array) -> set[int]:
    return {i for i, v in enumerate(logits.reshape(-1).tolist()) if v != float("-inf")}


def test_budget_counts_reasoning_tokens_then_forces_the_end():
    proc = ThinkingBudgetProcessor(3, start_ids=[50], end_ids=[51, 52])
    logits = mx.zeros((1, 60))
    context = [1, 2, 3]
    assert allowed(proc(mx.array(context), logits)) == set(range(60))  # outside: free
    for token in (9, 50, 10, 11):  # 9 outside, then <think>, two reasoning tokens
        context.append(token)
        assert len(allowed(proc(mx.array(context), logits))) == 60
    context.append(12)  # the third reasoning token: the budget is spent
    assert allowed(proc(mx.array(context), logits)) == {51}
    context.append(51)
    assert allowed(proc(mx.array(context), logits)) == {52}  # multi-token end marker
    context.append(52)
    assert len(allowed(proc(mx.array(context), logits))) == 60
    assert (proc.state, proc.count) == ("done", 3)
    context += [50, 1, 2, 3, 4]  # a later block is not budgeted
    assert len(allowed(proc(mx.array(context), logits))) == 60


def test_budget_reads_an_open_block_from_the_prompt():
    logits = mx.zeros((1, 60))
    opened = ThinkingBudgetProcessor(0, start_ids=[50], end_ids=[51])
    assert allowed(opened(mx.array([1, 50, 4]), logits)) == {51}  # "<think>\n" ends the prompt
    closed = ThinkingBudgetProcessor(0, start_ids=[50], end_ids=[51])
    assert len(allowed(closed(mx.array([1, 50, 4, 51, 4]), logits))) == 60


def test_model_closing_the_block_itself_stops_the_count():
    proc = ThinkingBudgetProcessor(2, start_ids=[50], end_ids=[51], starts_inside=True)
    logits = mx.zeros((1, 60))
    proc(mx.array([1]), logits)
    for context in ([1, 7], [1, 7, 51], [1, 7, 51, 8, 9, 10]):
        assert len(allowed(proc(mx.array(context), logits))) == 60
    assert (proc.state, proc.count) == ("done", 1)


def test_negative_budget_is_rejected():
    with pytest.raises(InvalidRequestError) as info:
        ThinkingBudgetProcessor(-1, [1], [2])
    assert info.value.param == "thinking_budget"


# -- the budget, on the demo model -----------------------------------------------


def run_demo(demo_model, prompt: list[int], processors: list[list[Any]], seed: int,
             max_tokens: int = 40) -> list[list[int]]:
    from mlx_lm.generate import BatchGenerator

    eos = sorted(demo_model.tokenizer.eos_token_ids)
    n = len(processors)
    gen = BatchGenerator(demo_model.model, stop_tokens=[[e] for e in eos],
                         completion_batch_size=n, prefill_batch_size=n)
    try:
        uids = gen.insert([prompt] * n, max_tokens=[max_tokens] * n,
                          samplers=[sampling.make_sampler(SamplingParams(seed=seed + i))
                                    for i in range(n)],
                          logits_processors=processors)
        out: dict[int, list[int]] = {u: [] for u in uids}
        done = 0
        while done < n:
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
                done += r.finish_reason is not None
    finally:
        gen.close()
    return [out[u] for u in uids]


@pytest.mark.parametrize("budget", [0, 1, 5, 12])
def test_demo_closes_the_block_after_exactly_the_budget(demo_model, budget):
    tok = demo_model.tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    # The prompt opens the block; the model may neither close it nor stop on its own.
    prompt = tok.encode_chat([{"role": "user", "content": "Think."}]) + [think]
    no_exit = sampling.make_processors(SamplingParams(
        logit_bias={end: -100, **{e: -100 for e in tok.eos_token_ids}}))
    procs = [[*no_exit, make_thinking_budget_processor(tok, budget)] for _ in range(3)]
    for tokens in run_demo(demo_model, prompt, procs, seed=budget):
        assert tokens.index(end) == budget
        assert tokens.count(end) == 1  # free again afterwards, and never forced twice


def test_demo_block_opened_by_the_model_is_budgeted(demo_model):
    tok = demo_model.tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")

    def open_first(tokens: mx.array, logits: mx.array) -> mx.array:
        # The model "decides" to think: <think> is its first token, and only then.
        nonlocal first
        if first:
            first = False
            return mx.where(mx.arange(logits.shape[-1]) == think, 0.0, -mx.inf)[None]
        return logits

    first = True
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    free = make_thinking_budget_processor(tok, 4)
    (tokens,) = run_demo(demo_model, prompt, [[open_first, free]], seed=3)
    assert tokens[0] == think and tokens[5] == end


def test_no_budget_no_processor(demo_model):
    assert make_thinking_budget_processor(demo_model.tokenizer, None) is None
    assert make_thinking_budget_processor(fake_tokenizer(set()), 10) is None


# -- template variables -----------------------------------------------------------


def test_request_values_win_over_the_profile():
    profile = {"enable_thinking": True, "custom": 1, "reasoning_effort": "high"}
    assert template_kwargs(False, None, {"custom": 2}, profile) == {
        "enable_thinking": False, "custom": 2, "reasoning_effort": "high"}


@pytest.mark.parametrize("effort, expected", [
    ("none", {"reasoning_effort": "low", "enable_thinking": False}),
    ("minimal", {"reasoning_effort": "low", "enable_thinking": False}),
    ("low", {"reasoning_effort": "low", "enable_thinking": True}),
    ("medium", {"reasoning_effort": "medium", "enable_thinking": True}),
    ("high", {"reasoning_effort": "high", "enable_thinking": True}),
    ("xhigh", {"reasoning_effort": "high", "enable_thinking": True}),
])
def test_effort_mapping(effort, expected):
    assert template_kwargs(reasoning_effort=effort) == expected


def test_explicit_values_beat_the_effort():
    assert template_kwargs(True, "none") == {"reasoning_effort": "low", "enable_thinking": True}
    assert template_kwargs(None, "high", {"reasoning_effort": "medium"}) == {
        "reasoning_effort": "medium", "enable_thinking": True}
    assert template_kwargs() == {}


def test_unknown_effort_is_rejected():
    with pytest.raises(InvalidRequestError) as info:
        template_kwargs(reasoning_effort="extreme")
    assert info.value.param == "reasoning_effort"


def test_demo_template_accepts_the_kwargs(demo_model):
    # Unknown template variables are ignored by Jinja: rendering must not fail.
    text = demo_model.tokenizer.render_chat([{"role": "user", "content": "hi"}],
                                            **template_kwargs(False, "low"))
    assert text.endswith("<|im_start|>assistant\n")
