"""The model worker: generation, sampling parameters, stop handling, batching, cancel."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gmlx.engine.errors import InvalidRequestError, PromptTooLongError
from gmlx.engine.types import FinishReason, GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def prompt(demo_model, text: str = "Hello there") -> tuple[int, ...]:
    return tuple(demo_model.tokenizer.encode_chat([{"role": "user", "content": text}]))


def run(worker, request):
    events = list(worker.generate(request))
    final = events[-1]
    assert final.final and all(not e.final for e in events[:-1])
    return "".join(e.text for e in events), final, events


def test_max_tokens_ends_with_length(demo_worker, demo_model):
    text, final, events = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=7, sampling=GREEDY))
    assert final.finish_reason is FinishReason.LENGTH
    assert final.usage.completion_tokens == 7
    assert final.usage.prompt_tokens == len(prompt(demo_model))
    assert sum(len(e.token_ids) for e in events) == 7
    assert text


def test_greedy_is_deterministic(demo_worker, demo_model):
    req = lambda: GenerateRequest(prompt(demo_model), max_tokens=20, sampling=GREEDY)
    assert run(demo_worker, req())[0] == run(demo_worker, req())[0]


def test_same_seed_same_output_other_seed_differs(demo_worker, demo_model):
    def sample(seed: int) -> str:
        params = SamplingParams(temperature=1.0, seed=seed)
        return run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=24, sampling=params))[0]

    first = sample(11)
    assert sample(11) == first
    assert any(sample(s) != first for s in (12, 13, 14))


def test_top_k_1_equals_greedy(demo_worker, demo_model):
    greedy = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=16, sampling=GREEDY))[0]
    params = SamplingParams(temperature=1.5, top_k=1, seed=3)
    assert run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=16, sampling=params))[0] == greedy


def test_tiny_top_p_and_high_min_p_collapse_to_greedy(demo_worker, demo_model):
    greedy = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=16, sampling=GREEDY))[0]
    for params in (SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
                   SamplingParams(temperature=1.0, min_p=0.999, seed=1)):
        out = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=16, sampling=params))[0]
        assert out == greedy


def test_logit_bias_bans_and_forces_tokens(demo_worker, demo_model):
    _, _, events = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=12, sampling=GREEDY))
    greedy_ids = [t for e in events for t in e.token_ids]
    banned = {t: -100.0 for t in set(greedy_ids)}
    _, _, events = run(demo_worker, GenerateRequest(
        prompt(demo_model), max_tokens=12, sampling=SamplingParams(temperature=0.0, logit_bias=banned)))
    assert not {t for e in events for t in e.token_ids} & set(banned)

    forced = demo_model.tokenizer.encode(" weather", add_special_tokens=False)[0]
    _text, _, events = run(demo_worker, GenerateRequest(
        prompt(demo_model), max_tokens=5,
        sampling=SamplingParams(temperature=1.0, seed=0, logit_bias={forced: 100.0})))
    assert [t for e in events for t in e.token_ids] == [forced] * 5


def test_eos_ends_with_stop_and_is_not_emitted(demo_worker, demo_model):
    eos = min(demo_model.tokenizer.eos_token_ids)
    params = SamplingParams(temperature=0.0, logit_bias={eos: 100.0})
    text, final, events = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=10, sampling=params))
    assert final.finish_reason is FinishReason.STOP
    assert text == ""
    assert final.usage.completion_tokens == 1
    assert all(eos not in e.token_ids for e in events)


def test_repetition_penalty_changes_a_repetitive_output(demo_worker, demo_model):
    p = prompt(demo_model, "x")  # greedy output of the demo repeats " retu" here
    plain = run(demo_worker, GenerateRequest(p, max_tokens=20, sampling=GREEDY))[0]
    assert plain.count("retu") > 3
    for params in (SamplingParams(temperature=0.0, repetition_penalty=3.0),
                   SamplingParams(temperature=0.0, presence_penalty=2.0),
                   SamplingParams(temperature=0.0, frequency_penalty=2.0)):
        out = run(demo_worker, GenerateRequest(p, max_tokens=20, sampling=params))[0]
        assert out != plain
        assert out.count("retu") < plain.count("retu")


def test_stop_string_across_token_boundary(demo_worker, demo_model):
    p = prompt(demo_model)
    text, _, events = run(demo_worker, GenerateRequest(p, max_tokens=30, sampling=GREEDY))
    pieces = [demo_model.tokenizer.decode(e.token_ids) for e in events if e.token_ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    expected = text[: text.find(stop)]
    out, final, _ = run(demo_worker, GenerateRequest(p, max_tokens=30, sampling=GREEDY, stop=(stop,)))
    assert final.finish_reason is FinishReason.STOP
    assert out == expected
    assert stop not in out


def test_concurrent_requests_match_sequential(demo_worker, demo_model):
    texts = ["Hello there", "What is the weather in Paris today?", "x", "def main(): return 0"]
    reqs = [
        lambda t=t, s=s: GenerateRequest(prompt(demo_model, t), max_tokens=16, sampling=s)
        for t in texts
        for s in (GREEDY, SamplingParams(temperature=0.9, seed=5))
    ]
    sequential = [run(demo_worker, r())[0] for r in reqs]
    handles = [demo_worker.submit(r()) for r in reqs]
    together = ["".join(e.text for e in h) for h in handles]
    assert together == sequential


def test_cancel_ends_stream_and_frees_slot(demo_worker, demo_model):
    handle = demo_worker.submit(GenerateRequest(prompt(demo_model), max_tokens=4000, sampling=GREEDY))
    for seen, event in enumerate(handle, 1):
        if event.final:
            break
        if seen == 3:
            handle.cancel()
    assert event.finish_reason is FinishReason.CANCELLED
    assert event.usage.completion_tokens >= 3
    # The worker is free again.
    _, final, _ = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=3, sampling=GREEDY))
    assert final.finish_reason is FinishReason.LENGTH


def test_cancel_while_queued(demo_model):
    from gmlx.engine.worker import ModelWorker

    worker = ModelWorker(demo_model, decode_batch=1)
    try:
        long = worker.submit(GenerateRequest(prompt(demo_model), max_tokens=200, sampling=GREEDY))
        queued = worker.submit(GenerateRequest(prompt(demo_model), max_tokens=5, sampling=GREEDY))
        queued.cancel()
        events = list(queued)
        assert [e.finish_reason for e in events] == [FinishReason.CANCELLED]
        assert events[0].usage.completion_tokens == 0
        long.cancel()
        assert list(long)[-1].finish_reason is FinishReason.CANCELLED
    finally:
        worker.close()


def test_async_consumption(demo_worker, demo_model):
    async def main() -> list[str]:
        async def one(text: str) -> str:
            handle = demo_worker.submit(GenerateRequest(prompt(demo_model, text), max_tokens=8, sampling=GREEDY))
            return "".join([e.text async for e in handle])

        return await asyncio.gather(one("a"), one("b"))

    results = asyncio.run(main())
    assert results == [
        run(demo_worker, GenerateRequest(prompt(demo_model, t), max_tokens=8, sampling=GREEDY))[0]
        for t in ("a", "b")
    ]


@pytest.mark.parametrize(
    "request_kwargs, error, words",
    [
        ({"prompt_tokens": ()}, InvalidRequestError, "empty"),
        ({"max_tokens": 0}, InvalidRequestError, "max_tokens"),
        ({"max_tokens": 9000}, PromptTooLongError, "prompt is too long"),
        ({"prompt_tokens": (10**7,)}, InvalidRequestError, "vocabulary"),
        ({"sampling": SamplingParams(temperature=-1)}, InvalidRequestError, "temperature"),
        ({"sampling": SamplingParams(top_p=0)}, InvalidRequestError, "top_p"),
        ({"sampling": SamplingParams(logit_bias={10**7: 1.0})}, InvalidRequestError, "logit_bias"),
    ],
)
def test_bad_requests_fail_before_queueing(demo_worker, demo_model, request_kwargs, error, words):
    kwargs = {"prompt_tokens": prompt(demo_model), "max_tokens": 4, **request_kwargs}
    with pytest.raises(error) as info:
        demo_worker.submit(GenerateRequest(**kwargs))
    assert words in str(info.value)
    assert info.value.status == 400


def test_prompt_too_long_names_counts_and_budget(demo_worker, demo_model):
    p = prompt(demo_model)
    with pytest.raises(PromptTooLongError) as info:
        demo_worker.submit(GenerateRequest(p, max_tokens=demo_model.context_length))
    msg = str(info.value)
    assert msg.startswith("prompt is too long")
    assert str(len(p)) in msg and str(demo_model.context_length) in msg


def test_step_failure_is_reported_not_hung(demo_model):
    """A forward pass that raises ends each running request with the error; the
    worker survives and takes the next request."""
    import dataclasses

    from gmlx.engine.errors import EngineError
    from gmlx.engine.worker import ModelWorker

    class FailsOnce:
        def __init__(self, model):
            self._model = model
            self.failed = False

        def __call__(self, *args, **kwargs):
            if not self.failed:
                self.failed = True
                raise RuntimeError("simulated device failure")
            return self._model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._model, name)

    flaky = FailsOnce(demo_model.model)
    worker = ModelWorker(dataclasses.replace(demo_model, model=flaky), decode_batch=2)
    try:
        handle = worker.submit(GenerateRequest(prompt(demo_model), max_tokens=5, sampling=GREEDY))
        with pytest.raises(EngineError, match="simulated device failure"):
            list(handle)
        _, final, _ = run(worker, GenerateRequest(prompt(demo_model), max_tokens=3, sampling=GREEDY))
        assert final.finish_reason is FinishReason.LENGTH
    finally:
        worker.close()


@pytest.mark.parametrize("where", ["processor", "sampler"])
def test_a_request_that_fails_alone_ends_alone(demo_model, monkeypatch, where):
    """A request whose own processor or sampler raises ends with the error; the request
    decoding beside it in the same batch runs to its end, token for token as alone."""
    from gmlx.engine import sampling
    from gmlx.engine.errors import EngineError
    from gmlx.engine.worker import ModelWorker

    def broken(*args):
        raise ValueError("schema engine crashed")

    bad_seed = 4242
    if where == "processor":
        real = sampling.make_processors
        monkeypatch.setattr(sampling, "make_processors",
                            lambda params: real(params) + ([broken] if params.seed == bad_seed else []))
    else:
        real = sampling.make_sampler
        monkeypatch.setattr(sampling, "make_sampler",
                            lambda params, protected=None: broken if params.seed == bad_seed else real(params, protected))
    worker = ModelWorker(demo_model, decode_batch=4)
    try:
        good_req = GenerateRequest(prompt(demo_model), max_tokens=24, sampling=GREEDY)
        alone, _, _ = run(worker, good_req)
        good = worker.submit(dataclasses.replace(good_req, id="req-good"))
        bad = worker.submit(GenerateRequest(prompt(demo_model, "Another question"), max_tokens=24,
                                            sampling=SamplingParams(temperature=0.7, seed=bad_seed)))
        with pytest.raises(EngineError, match="schema engine crashed"):
            list(bad)
        events = list(good)
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert "".join(e.text for e in events) == alone
    finally:
        worker.close()


def test_logprobs_of_greedy_tokens_are_the_top_alternative(demo_worker, demo_model):
    req = GenerateRequest(prompt(demo_model), max_tokens=8, sampling=GREEDY, logprobs=True, top_logprobs=3)
    _, _, events = run(demo_worker, req)
    tokens = [e for e in events if e.token_ids]
    assert len(tokens) == 8
    for e in tokens:
        assert e.logprob is not None and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        values = [v for _, v in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0] == (e.token_ids[0], pytest.approx(e.logprob))


def test_no_logprobs_unless_asked(demo_worker, demo_model):
    _, _, events = run(demo_worker, GenerateRequest(prompt(demo_model), max_tokens=3, sampling=GREEDY))
    assert all(e.logprob is None and e.top_logprobs == () for e in events)


def test_warm_up_runs_every_batch_width_and_leaves_no_trace(demo_model, monkeypatch):
    from gmlx.engine import stats as stats_module
    from gmlx.engine.worker import ModelWorker

    widths: list[int] = []
    real = stats_module.WorkerStats.note_step
    monkeypatch.setattr(stats_module.WorkerStats, "note_step",
                        lambda self, tokens: (widths.append(tokens), real(self, tokens)))
    rendered: list[list[dict]] = []
    encode_chat = demo_model.tokenizer.encode_chat
    monkeypatch.setattr(demo_model.tokenizer, "encode_chat",
                        lambda messages, **kw: (rendered.append(messages), encode_chat(messages, **kw))[1])
    from mlx_lm.generate import PromptProcessingBatch

    from gmlx.engine.scheduling import SHORT_PROMPTS, prefill_step

    chunks: list[int] = []
    real_prompt = PromptProcessingBatch.prompt
    monkeypatch.setattr(PromptProcessingBatch, "prompt",
                        lambda self, tokens: (chunks.append(max(map(len, tokens), default=0)), real_prompt(self, tokens))[1])
    worker = ModelWorker(demo_model, decode_batch=5)
    tiers: list[str] = []
    fetch = worker.prompt_cache.fetch
    monkeypatch.setattr(worker.prompt_cache, "fetch",
                        lambda tokens: (lookup := fetch(tokens), tiers.append(lookup.tier))[0])
    try:
        assert worker.warm_up(prefills=True) > 0  # on by default on an accelerator only
        assert set(range(1, 6)) <= set(widths)  # 1 up to decode_batch, every one of them
        # the prefill shapes: a whole chunk alone, the smaller one beside a decoding
        # stream, and a prompt-cache hit
        step = worker.prefill_step_size
        assert step in chunks and prefill_step(step, decoding=1, waiting=1) in chunks
        # short prompts, alone (the last token of a prompt goes to its first decode step)
        assert {n - 1 for n in SHORT_PROMPTS} <= set(chunks)
        assert "exact" in tiers
        assert rendered  # the chat template is compiled before the first conversation
        cache = worker.prompt_cache.stats()
        assert cache["entries"] == 0 and cache["hits"] == cache["misses"] == 0
        assert worker.stats.requests_finished == 0 and worker.in_flight == 0 and worker.waiting == 0
        _, final, _ = run(worker, GenerateRequest(prompt(demo_model), max_tokens=3, sampling=GREEDY))
        assert final.finish_reason is FinishReason.LENGTH and final.cache_tier == "miss"
    finally:
        worker.close()


def test_a_burst_of_short_prompts_prefills_together_and_answers_as_alone(demo_model, monkeypatch):
    """Short prompts that arrive together share prefill steps (as many as fit one
    chunk's tokens); each answer is the one it gets alone."""
    from mlx_lm.generate import PromptProcessingBatch

    from gmlx.engine.worker import ModelWorker

    widths: list[int] = []
    real_prompt = PromptProcessingBatch.prompt
    monkeypatch.setattr(PromptProcessingBatch, "prompt",
                        lambda self, tokens: (widths.append(len(tokens)), real_prompt(self, tokens))[1])
    texts = ["Hi", "Tell me about Paris", "What is the weather like in Tokyo today?", "Count to three"]
    requests = [GenerateRequest(prompt(demo_model, t), max_tokens=10, sampling=GREEDY) for t in texts]
    worker = ModelWorker(demo_model, decode_batch=4, prefill_step_size=512)
    try:
        alone = [run(worker, r)[0] for r in requests]
        for attempt in range(3):  # the worker may start the first before the rest arrive
            worker.prompt_cache.reset()  # no hits: every prompt prefills
            widths.clear()
            handles = [worker.submit(dataclasses.replace(r, id=f"req-burst-{attempt}-{i}"))
                       for i, r in enumerate(requests)]
            together = ["".join(e.text for e in h) for h in handles]
            assert together == alone
            if max(widths) > 1:
                break
        assert max(widths) > 1  # some prefill step carried more than one prompt
    finally:
        worker.close()


def test_a_long_prompt_prefills_in_smaller_chunks_while_others_decode(demo_model, monkeypatch):
    """Alone, a prompt prefills in chunks of prefill_step_size; while other streams
    decode, in the waiting prompts' share of it (in quarters), so those streams wait
    less for each token: half beside one stream, a quarter beside three."""
    from mlx_lm.generate import PromptProcessingBatch

    from gmlx.engine.worker import ModelWorker

    chunks: list[int] = []
    real_prompt = PromptProcessingBatch.prompt
    monkeypatch.setattr(PromptProcessingBatch, "prompt",
                        lambda self, tokens: (chunks.extend(len(t) for t in tokens), real_prompt(self, tokens))[1])
    long_prompt = tuple((7 * i + 3) % 400 + 10 for i in range(700))
    worker = ModelWorker(demo_model, decode_batch=4, prefill_step_size=256, prompt_cache_bytes=0)
    try:
        run(worker, GenerateRequest(long_prompt, max_tokens=2, sampling=GREEDY))
        assert max(chunks) == 256  # alone: whole chunks
        running = []
        for streams, chunk in ((1, 128), (3, 64)):
            while len(running) < streams:
                running.append(worker.submit(GenerateRequest(prompt(demo_model, f"go {len(running)}"),
                                                             max_tokens=1000, sampling=GREEDY)))
                assert next(iter(running[-1])).token_ids  # it is decoding now
            chunks.clear()
            run(worker, GenerateRequest(long_prompt[::-1], max_tokens=2, sampling=GREEDY))
            assert chunks and max(chunks) == chunk, streams
        for handle in running:
            worker.cancel(handle.id)
            list(handle)
    finally:
        worker.close()


def test_a_burst_of_prompts_beside_a_decoding_stream_is_admitted_in_few_steps(demo_model, monkeypatch):
    """Eight short prompts arriving while one stream decodes prefill several a step (their
    share of the batch is most of a chunk), not one each step at a quarter chunk."""
    import threading

    from mlx_lm.generate import PromptProcessingBatch

    from gmlx.engine.batch import Batch
    from gmlx.engine.worker import ModelWorker

    steps: list[int] = []
    real_prompt = PromptProcessingBatch.prompt
    monkeypatch.setattr(PromptProcessingBatch, "prompt",
                        lambda self, tokens: (steps.append(len(tokens)), real_prompt(self, tokens))[1])
    held, hold, release = threading.Event(), threading.Event(), threading.Event()
    real_step = Batch.step

    def step(self, stats):  # the worker waits here while `hold` is set: the burst lands at once
        if hold.is_set():
            held.set()
            release.wait(10)
        return real_step(self, stats)

    monkeypatch.setattr(Batch, "step", step)
    worker = ModelWorker(demo_model, decode_batch=9, prefill_step_size=256, prompt_cache_bytes=0)
    try:
        running = worker.submit(GenerateRequest(prompt(demo_model), max_tokens=1000, sampling=GREEDY))
        assert next(iter(running)).token_ids
        hold.set()
        assert held.wait(10)
        steps.clear()
        burst = [tuple((11 * i + 5 * j) % 300 + 10 for j in range(60)) for i in range(8)]
        handles = [worker.submit(GenerateRequest(p, max_tokens=2, sampling=GREEDY)) for p in burst]
        hold.clear()
        release.set()
        for handle in handles:
            assert list(handle)[-1].finish_reason is FinishReason.LENGTH
        # 8 x 59 tokens beside 1 stream: a whole 256-token chunk (4 prompts), then half of
        # it (2 prompts) beside 5 streams, then a quarter (1) beside 7, and 1; a quarter
        # chunk throughout (64 tokens, one prompt) takes 8 steps
        assert [n for n in steps if n] == [4, 2, 1, 1], steps  # the generator also calls it with none
        worker.cancel(running.id)
        list(running)
    finally:
        worker.close()


def test_first_token_is_handed_out_before_the_next_step(demo_model, monkeypatch):
    """A request's first token reaches its stream as soon as the step that ends its
    prompt has computed it, not one generation step later (as mlx-lm returns it)."""
    from mlx_lm.generate import GenerationBatch

    from gmlx.engine.requests import RequestHandle
    from gmlx.engine.worker import ModelWorker

    steps = []
    step = GenerationBatch.next
    monkeypatch.setattr(GenerationBatch, "next", lambda self: (steps.append(len(self.uids)), step(self))[1])
    at_first: list[int] = []
    emit = RequestHandle._emit
    monkeypatch.setattr(RequestHandle, "_emit", lambda self, event: (
        at_first.append(sum(1 for n in steps if n)) if event.token_ids and not at_first else None,
        emit(self, event))[1])
    worker = ModelWorker(demo_model, decode_batch=2)
    try:
        _, final, _ = run(worker, GenerateRequest(prompt(demo_model), max_tokens=5, sampling=GREEDY))
    finally:
        worker.close()
    assert at_first == [0] and final.usage.completion_tokens == 5


def test_handing_out_first_tokens_changes_no_output(demo_model, monkeypatch):
    """Streams with and without the early first token are the same, event by event:
    log-probabilities, a stop string met at the first token, one- and two-token requests,
    and requests joining a running batch."""
    import threading

    from gmlx.engine import mlxlm
    from gmlx.engine.requests import ActiveRequest
    from gmlx.engine.worker import ModelWorker

    base = prompt(demo_model, "Tell me a story about a ship.")
    probe = ModelWorker(demo_model, decode_batch=1)
    try:
        first = run(probe, GenerateRequest(base, max_tokens=1, sampling=GREEDY))[0]  # its first text
    finally:
        probe.close()
    requests = [
        GenerateRequest(base, max_tokens=12, sampling=GREEDY, logprobs=True, top_logprobs=3, id="first"),
        GenerateRequest(base, max_tokens=12, sampling=GREEDY, stop=(first,)),
        GenerateRequest(prompt(demo_model, "One"), max_tokens=1, sampling=GREEDY),
        GenerateRequest(prompt(demo_model, "Two"), max_tokens=2, sampling=GREEDY),
        GenerateRequest(prompt(demo_model, "Three, later"), max_tokens=9, sampling=GREEDY, id="joiner"),
    ]

    def streams() -> list:
        """Every request's events; the last one submitted while the first is held at its
        third decode step, so it joins a batch that is decoding (checked, not hoped)."""
        worker = ModelWorker(demo_model, decode_batch=4, prompt_cache_bytes=0)
        out = [None] * len(requests)
        held, joined = threading.Event(), threading.Event()
        joined_beside: list[bool] = []  # at each step of the joiner: is the first still running?

        def gate(tokens, logits):  # the first request's: waits at its third step for the joiner
            if len(tokens) - len(base) == 2 and not joined.is_set():
                held.set()
                joined.wait(30)
            return logits

        def watch(tokens, logits):  # the joiner's: notes whether the first is decoding beside it
            joined_beside.append(worker.has_request("first"))
            return logits

        real = ActiveRequest.prepare.__func__

        def prepare(cls, handle, tokenizer, **kwargs):
            active = real(cls, handle, tokenizer, **kwargs)
            if handle.id in ("first", "joiner"):
                active.processors.append(gate if handle.id == "first" else watch)
            return active

        def one(i):
            if requests[i].id == "joiner":
                assert held.wait(30), "the first request never reached its third step"
                handle = worker.submit(requests[i])
                joined.set()
                events = list(handle)
            else:
                events = list(worker.generate(requests[i]))
            out[i] = [(e.text, e.token_ids, e.logprob, e.top_logprobs, e.finish_reason) for e in events]

        with monkeypatch.context() as patch:
            patch.setattr(ActiveRequest, "prepare", classmethod(prepare))
            try:
                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
            finally:
                worker.close()
        assert joined_beside and joined_beside[0], "the joiner did not start beside a decoding request"
        return out

    early = streams()
    monkeypatch.setattr(mlxlm, "first_token", lambda gen, uid: None)  # mlx-lm hands out each
    assert streams() == early
    assert early[1][-1][-1] is FinishReason.STOP and early[2][-1][-1] is FinishReason.LENGTH
