"""Structured output: llguidance grammars run as mlx-lm logits processors.

A request's :class:`~gmlx.engine.types.ResponseFormat` is compiled and validated
up front, so a malformed schema is a 400 before any generation. At
admission the worker builds one :class:`GrammarProcessor` per constrained request;
each holds its own llguidance matcher, so constrained and free requests share a
batch. The llguidance tokenizer is built once per :class:`Tokenizer` and cached.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.tokenizer import Tokenizer
from gmlx.engine.types import Grammar, ResponseFormat

log = logging.getLogger("gmlx.engine")

# Compact JSON with Python's default separators: what models see most in training
# data, and flexible whitespace lets a weak model loop on blanks forever. A schema
# can still ask for other spacing through its own "x-guidance" options.
# ``lenient`` ignores keywords llguidance does not implement (uniqueItems, ...):
# the output is still valid JSON of the schema's shape, just less constrained.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}

def compile_format(fmt: ResponseFormat | None, close_thinking: str | None = None) -> Grammar | None:
    """Compile a request's response format into a grammar (None: unconstrained).

    ``close_thinking`` is the end marker of a thinking block the prompt left open, as a
    lark literal (:func:`lark_literal`): the grammar then writes it first, so the JSON is
    the answer and not reasoning text. Raises InvalidRequestError (its param the
    format's ``field``) for a missing or malformed schema, or one llguidance rejects.
    """
    if fmt is None:
        return None
    schema = {"type": "object"} if fmt.kind == "json_object" else fmt.schema
    name = fmt.name if fmt.kind == "json_schema" else None
    text = _compile(schema, fmt.field)  # validates the schema either way
    if close_thinking is not None:
        options = {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}
        # As for a forced tool call: the newline before the marker is optional, so a
        # thinking budget that forces the marker at once agrees with the grammar.
        lark = (f'start: "\\n"? {close_thinking} "\\n\\n" answer\n'
                f"answer: %json {json.dumps({**schema, 'x-guidance': options})}")
        text = LLMatcher.grammar_from_lark(lark)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text)
        if is_error:
            raise InvalidRequestError(f"Invalid JSON schema: {messages[0]}", param=fmt.field)
    return Grammar(text, fmt.kind, name)


def lark_literal(tokenizer: Tokenizer, text: str) -> str:
    """``text`` in a lark grammar: a special token by its name (``<think>``), else the
    quoted text."""
    special = tokenizer.hf.get_added_vocab()
    return text if text in special and text.startswith("<") else json.dumps(text)


def _compile(schema: Any, param: str) -> str:
    """llguidance grammar text for a JSON schema, validated; raises InvalidRequestError."""
    if schema is None:
        raise InvalidRequestError("The JSON schema is missing.", param=param)
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(
            f"The JSON schema must be an object, not {type(schema).__name__}.", param=param
        )
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"Invalid JSON schema: {e}.", param=param) from e
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequestError(f"Invalid JSON schema: {messages[0]}", param=param)
    if messages:
        log.info("JSON schema accepted with warnings: %s", "; ".join(messages))
    return grammar


# -- the llguidance tokenizer, once per Tokenizer -----------------------------------

_llg_cache: weakref.WeakKeyDictionary[Tokenizer, LLTokenizer] = weakref.WeakKeyDictionary()
_llg_lock = threading.Lock()


def llg_tokenizer(tokenizer: Tokenizer) -> LLTokenizer:
    """The llguidance tokenizer of ``tokenizer``, built on first use and cached for as
    long as the Tokenizer lives (building walks the whole vocabulary: ~1 s for
    150k tokens). Its EOS tokens are ``tokenizer.eos_token_ids``."""
    with _llg_lock:  # two first requests must not build it twice
        cached = _llg_cache.get(tokenizer)
        if cached is None:
            import llguidance.hf

            eos = sorted(tokenizer.eos_token_ids)
            cached = llguidance.hf.from_tokenizer(tokenizer.hf, eos_token=eos or None)
            _llg_cache[tokenizer] = cached
        return cached


# -- the processor ------------------------------------------------------------------


class GeneratedTokens:
    """Which tokens a logits processor has not seen yet.

    mlx-lm calls a processor once per decode step with the whole context (prompt and
    tokens generated so far, 1-D in BatchGenerator, possibly (1, n) elsewhere). The
    first call comes before any token is generated, so its length marks where the
    prompt ends, whatever prefix the prompt cache supplied.
    """

    def __init__(self) -> None:
        self.seen: int | None = None  # context length at the previous call
        self.prompt_len: int | None = None

    def update(self, tokens: mx.array) -> list[int]:
        """The tokens appended since the previous call (none on the first call)."""
        n = tokens.shape[-1]
        if self.seen is None:
            self.seen = self.prompt_len = n
            return []
        new = tokens.reshape(-1)[self.seen :].tolist() if n > self.seen else []
        self.seen = n
        return new


def allow_only(logits: mx.array, token_ids: Iterable[int]) -> mx.array:
    """``logits`` with every id outside ``token_ids`` at -inf (the allowed keep theirs,
    but are lifted from -inf so a forced token is always drawable)."""
    keep = np.zeros(logits.shape[-1], dtype=bool)
    keep[[t for t in token_ids if 0 <= t < keep.size]] = True
    allowed = mx.array(keep)
    safe = mx.maximum(logits, mx.array(mx.finfo(logits.dtype).min, dtype=logits.dtype))
    return mx.where(allowed, safe, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarProcessor:
    """An mlx-lm logits processor that keeps one request's output inside a grammar.

    Each call feeds the tokens sampled since the previous call to the request's
    llguidance matcher and masks every token the grammar does not allow next,
    including ids past the tokenizer's vocabulary when the model's head is wider.
    Once the grammar is complete (or the matcher failed), only EOS is allowed, so the
    request ends instead of rambling. State is per instance: one per request.
    """

    def __init__(self, tokenizer: Tokenizer, grammar: Grammar) -> None:
        llt = llg_tokenizer(tokenizer)
        self.matcher = LLMatcher(llt, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise InvalidRequestError(
                f"The grammar cannot run on this model: {self.matcher.get_error()}",
                param="response_format",
            )
        self.eos_token_ids = tuple(sorted(tokenizer.eos_token_ids)) or (llt.eos_token,)
        self._tokens = GeneratedTokens()
        self._bitmask = np.zeros((1, (llt.vocab_size + 31) // 32), dtype=np.int32)

    @property
    def done(self) -> bool:
        """True once the grammar is complete or broken: only EOS can follow."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        for token in self._tokens.update(tokens):
            if self.done:
                break  # EOS and what mlx-lm computes past it are not the grammar's
            if not self.matcher.consume_token(token):
                log.warning("grammar rejected token %d: %s", token, self.matcher.get_error())
        if self.done:
            return allow_only(logits, self.eos_token_ids)
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask)
        # Little-endian int32 words viewed as bytes, bits unpacked LSB first:
        # bit k of the result is token k.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        width = logits.shape[-1]
        if bits.size < width:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.uint8)])
        allowed = mx.array(bits[:width].astype(bool))
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def make_grammar_processor(tokenizer: Tokenizer, grammar: Grammar | None) -> GrammarProcessor | None:
    """A fresh processor for one request, or None for an unconstrained one. The mask
    covers the logits' full width, so a model head wider than the tokenizer's
    vocabulary needs no extra argument."""
    return None if grammar is None else GrammarProcessor(tokenizer, grammar)
