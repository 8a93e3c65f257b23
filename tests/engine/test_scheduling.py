"""The worker's scheduling choices, as the pure functions they are."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gmlx.engine import scheduling
from gmlx.engine.scheduling import (
    DEFAULT_REQUEST_S,
    MIN_SHARED_PREFILL_STEP,
    prefill_step,
    prefill_width,
    queue_eta_s,
    queue_full,
    queued,
    retry_after_s,
    shed_victim,
    warm_up_requests,
)


def test_alone_a_prompt_prefills_in_whole_chunks():
    assert prefill_step(512, decoding=0) == 512
    assert prefill_step(2048, decoding=0) == 2048


def test_beside_decoding_streams_the_waiting_prompts_prefill_their_share_in_quarter_chunks():
    assert prefill_step(512, decoding=0, waiting=5) == 512
    assert prefill_step(512, decoding=3, waiting=1) == 128  # a quarter of the requests: a quarter
    assert prefill_step(2048, decoding=8, waiting=1) == 512  # less: still a quarter
    assert prefill_step(2048, decoding=1, waiting=1) == 1024  # half: half
    assert prefill_step(2048, decoding=2, waiting=3) == 1536  # 3/5: rounded up to 3/4
    assert prefill_step(2048, decoding=1, waiting=31) == 2048  # a burst beside one stream
    assert prefill_step(512, decoding=4, waiting=0) == 128
    assert prefill_step(128, decoding=3, waiting=1) == MIN_SHARED_PREFILL_STEP  # never below the floor


@given(step=st.sampled_from([128, 512, 2048]), decoding=st.integers(1, 64), waiting=st.integers(0, 64))
def test_a_shared_chunk_is_a_whole_number_of_quarters_growing_with_the_waiting(step, decoding, waiting):
    chunk = prefill_step(step, decoding, waiting)
    assert chunk in {max(MIN_SHARED_PREFILL_STEP, step * q // 4) for q in (1, 2, 3, 4)}
    assert chunk >= step * waiting // (waiting + decoding)  # at least the waiting prompts' share
    assert prefill_step(step, decoding, waiting + 1) >= chunk
    assert prefill_step(step, decoding + 1, waiting) <= chunk


@pytest.mark.parametrize("lengths, step, width", [
    ([], 512, 1),  # nothing to prefill: the generator's own default
    ([700], 512, 1),  # one long prompt: one chunk
    ([10, 20, 30, 40], 512, 4),  # a burst of short prompts: one step
    ([100, 100, 100, 100, 100, 100], 512, 5),  # 6 x 100 > 512: the sixth waits
    ([10, 400, 10], 512, 1),  # padded to 400, two would take 800
    ([200, 200, 900], 512, 2),  # the long one counts as a whole chunk: 3 x 512 > 512
    ([600, 10], 512, 1),  # a chunk already fills the step
    ([0, 311, 311], 512, 2),  # the first leaves for decoding: the next starts beside it
    ([0, 0, 200, 200, 200], 512, 4),  # places without rows, then two rows of 200
    ([0], 512, 1),
])
def test_prefill_width_keeps_a_step_within_one_chunk(lengths, step, width):
    assert prefill_width(lengths, step) == width


def test_prefill_width_reads_in_arrival_order():
    assert prefill_width(iter([50, 50, 300]), 256) == 2  # an iterator is enough


@dataclass
class Running:
    name: str
    tokens_held: int


def test_the_shed_victim_holds_the_most_tokens():
    running = [Running("a", 100), Running("b", 900), Running("c", 300)]
    assert shed_victim(running).name == "b"  # type: ignore[union-attr]
    assert shed_victim([Running("x", 5), Running("y", 5)]).name == "x"  # type: ignore[union-attr]
    assert shed_victim([]) is None


def test_the_queue_is_full_when_waiting_fills_the_free_slots_and_the_cap():
    assert not queue_full(waiting=0, queue_cap=0, free_slots=1)  # a free slot takes it
    assert queue_full(waiting=1, queue_cap=0, free_slots=1)
    assert not queue_full(waiting=5, queue_cap=4, free_slots=2)
    assert queue_full(waiting=6, queue_cap=4, free_slots=2)
    assert queue_full(waiting=0, queue_cap=0, free_slots=0)  # busy and no queue


def test_queued_counts_only_those_beyond_the_free_slots():
    assert queued(waiting=3, free_slots=1) == 2
    assert queued(waiting=1, free_slots=4) == 0


def test_the_drain_eta_counts_whole_batches():
    assert queue_eta_s(0, decode_batch=4, mean_request_s=3.0) == 0.0
    assert queue_eta_s(1, decode_batch=4, mean_request_s=3.0) == 3.0
    assert queue_eta_s(4, decode_batch=4, mean_request_s=3.0) == 3.0
    assert queue_eta_s(5, decode_batch=4, mean_request_s=3.0) == 6.0


def test_before_any_request_finished_one_takes_the_default():
    assert queue_eta_s(3, decode_batch=1, mean_request_s=None) == 3 * DEFAULT_REQUEST_S
    assert DEFAULT_REQUEST_S == 5.0


@pytest.mark.parametrize("eta, retry", [(0.0, 2), (1.4, 2), (7.6, 8), (59.6, 60), (500.0, 60)])
def test_retry_after_is_the_eta_within_its_range(eta, retry):
    assert retry_after_s(eta) == retry
    low, high = scheduling.RETRY_AFTER_RANGE
    assert low <= retry_after_s(eta) <= high


def test_warm_up_requests_leave_one_by_one_and_never_early():
    ramp = warm_up_requests(4, vocab_size=50, eos_ids={0, 7})
    assert [r.max_tokens for r in ramp] == [10, 11, 12, 13]  # each past the last's admission
    assert len({r.id for r in ramp}) == 4
    for r in ramp:
        assert len(r.prompt_tokens) == 8 and all(0 <= t < 50 for t in r.prompt_tokens)
        assert r.sampling.greedy and dict(r.sampling.logit_bias or {}) == {0: -100.0, 7: -100.0}
