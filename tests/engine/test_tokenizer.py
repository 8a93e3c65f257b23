"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from gmlx.engine.tokenizer import IncrementalDetokenizer, StopMatcher

TRICKY = [
    "Hello, world!",
    "héllo wörld — naïve café",
    "emoji 🙂🎉👩‍👩‍👧 and flags 🇫🇷",
    "中文字符 和 日本語のテキスト 한국어",
    "  leading spaces\tand\ttabs\n\nnewlines  ",
    "math: ∑ x² ≤ ∞; arrows → ⇒",
]


def stream(tok, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.add(t) for t in ids]
    chunks.append(detok.flush())
    return chunks


@pytest.mark.parametrize("text", TRICKY)
def test_stream_decoding_never_breaks_characters(demo_model, text):
    tok = demo_model.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    chunks = stream(tok, ids)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_multibyte_character_split_across_tokens_is_held_back(demo_model):
    tok = demo_model.tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the demo vocabulary should spell emoji as byte tokens"
    chunks = stream(tok, ids)
    assert chunks[:-2] == [""] * (len(ids) - 1)  # nothing until the last byte arrives
    assert "".join(chunks) == "🎉"


def test_flush_releases_an_incomplete_tail(demo_model):
    tok = demo_model.tokenizer
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add(t) for t in ids[:-1])
    assert out == "ok"  # the space travels with the emoji's first byte token
    tail = detok.flush()
    assert out + tail == tok.decode(ids[:-1])  # incomplete bytes surface as U+FFFD
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert detok.flush() == ""


def test_stream_matches_full_decode_on_random_ids(demo_model):
    import random

    tok = demo_model.tokenizer
    rng = random.Random(0)
    ids = [rng.randrange(len(tok)) for _ in range(300)]
    assert "".join(stream(tok, ids)) == tok.decode(ids)


class TestStopMatcher:
    def test_no_stops_passes_text_through(self):
        m = StopMatcher([])
        assert m.feed("abc") == ("abc", False)

    def test_stop_inside_one_chunk(self):
        m = StopMatcher(["END"])
        assert m.feed("helloENDworld") == ("hello", True)
        assert m.feed("more") == ("", True)

    def test_stop_split_across_chunks_is_never_emitted(self):
        m = StopMatcher(["</s>"])
        out = []
        for piece in ["ab", "c<", "/", "s", ">tail"]:
            text, hit = m.feed(piece)
            out.append(text)
        assert "".join(out) == "abc"
        assert hit

    def test_partial_match_is_released_when_it_diverges(self):
        m = StopMatcher(["STOP"])
        assert m.feed("xST") == ("x", False)
        assert m.feed("OX") == ("STOX", False)
        assert m.flush() == ""

    def test_held_tail_flushes_at_end(self):
        m = StopMatcher(["STOP"])
        assert m.feed("abcSTO") == ("abc", False)
        assert m.flush() == "STO"

    def test_earliest_of_several_stops_wins(self):
        m = StopMatcher(["world", "lo w"])
        assert m.feed("hello world") == ("hel", True)

    def test_stop_at_start(self):
        m = StopMatcher(["\n"])
        assert m.feed("\nrest") == ("", True)


def test_prefix_reuse_checks_itself_and_turns_off_on_a_mismatch(demo_model, monkeypatch):
    """The first reuses are checked against a full tokenization: a tokenizer for which
    cutting at special tokens changed the tokens gets the full tokens, and no reuse."""
    from gmlx.engine.tokenizer import PrefixReusingEncoder

    tok = demo_model.tokenizer
    encoder = PrefixReusingEncoder(tok._backend)
    assert encoder.enabled
    system = {"role": "system", "content": "You answer briefly. " * 30}
    first = tok.render_chat([system, {"role": "user", "content": "Paris?"}])
    second = tok.render_chat([system, {"role": "user", "content": "Tokyo?"}])
    encoder.encode(first)
    real = encoder._encode

    def one_token_off(text, at, k):
        ids, cuts = real(text, at, k)
        return [*ids, 0], cuts

    monkeypatch.setattr(encoder, "_encode", one_token_off)
    assert encoder.encode(second) == tok.encode(second, add_special_tokens=False)
    assert not encoder.enabled and encoder.reused_tokens == 0


def test_chat_tokenization_lets_other_threads_run(demo_model):
    """A long prompt tokenizes without holding the GIL, so a model worker keeps stepping
    and the event loop keeps streaming while it does. With the interpreter's switch
    interval out of reach, the only way for this thread to run while another one is in
    the tokenizer is that the tokenizer let go of the GIL: it does for our encoder, it
    does not for the Rust tokenizer's ``encode`` (which holds it throughout). How much
    that buys is measured by ``benchmarks/tokenize_gil.py``."""
    import sys
    import threading

    from gmlx.engine.tokenizer import PrefixReusingEncoder

    tok = demo_model.tokenizer
    text = tok.render_chat([{"role": "user", "content": "a long agent history, turn after turn. " * 1500}])
    encoder = PrefixReusingEncoder(tok._backend)
    assert encoder.encode(text) == tok._backend.encode(text, add_special_tokens=False).ids

    def ran_beside(tokenize) -> bool:
        """Whether this thread ran while another one was inside ``tokenize``."""
        inside = threading.Event()
        done = threading.Event()

        def work() -> None:
            inside.set()
            tokenize(text)
            done.set()

        thread = threading.Thread(target=work)
        thread.start()  # returns once the new thread lets go of the GIL (or ends)
        inside.wait(60)
        beside = not done.is_set()
        thread.join(60)
        return beside

    interval = sys.getswitchinterval()
    sys.setswitchinterval(3600)  # no thread is made to yield the GIL: only a release lets us in
    try:
        # A release is a window this thread must be scheduled in: on a loaded machine (a
        # CI run beside other work on two cores missed all of three) the OS may not wake
        # it before the tokenizer takes the GIL back, so ours gets up to twenty tries (the
        # first usually does); a tokenizer that holds the GIL never lets it in, however many.
        ours = any(ran_beside(encoder.encode) for _ in range(20))
        holding = [ran_beside(lambda t: tok._backend.encode(t, add_special_tokens=False)) for _ in range(3)]
    finally:
        sys.setswitchinterval(interval)
    assert ours and not any(holding)


def test_prefix_reuse_check_tokenizes_from_the_cut_before(demo_model, monkeypatch):
    """The check of a reuse tokenizes from the special token before the cut, not the
    whole history: its cost is the last shared message and the new text."""
    from gmlx.engine.tokenizer import PrefixReusingEncoder

    tok = demo_model.tokenizer
    encoder = PrefixReusingEncoder(tok._backend)
    system = {"role": "system", "content": "A long shared history. " * 200}
    first = tok.render_chat([system, {"role": "user", "content": "Paris?"}])
    second = tok.render_chat([system, {"role": "user", "content": "Paris?"},
                              {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Lima?"}])
    encoder.encode(first)
    seen: list[int] = []
    tokenize = encoder._tokenize
    monkeypatch.setattr(encoder, "_tokenize", lambda text: seen.append(len(text)) or tokenize(text))
    assert encoder.encode(second) == tok.encode(second, add_special_tokens=False)
    assert encoder.reused_tokens > 0 and encoder.enabled
    assert max(seen) < len(system["content"])  # neither the tail nor the check spans the history
