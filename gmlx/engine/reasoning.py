"""Reasoning: the thinking block's markers, splitting it from the answer, its budget,
and the template variables that turn it on and off.

A thinking model writes ``<think>…</think>`` (or its family's markers) before the
answer. :class:`ReasoningSplitter` separates the two in streamed text;
:class:`ThinkingBudgetProcessor` is an mlx-lm logits processor that closes the block
once it has used its token budget; :func:`template_kwargs` maps the request's
``enable_thinking`` / ``reasoning_effort`` onto chat-template variables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.structured import GeneratedTokens, allow_only
from gmlx.engine.tokenizer import Tokenizer, partial_suffix

# (start text, end text, the start and end tokens a vocabulary must hold). Gemma 4
# writes "<|channel>thought\n…<channel|>": the "thought" label belongs to the marker.
_MARKERS: tuple[tuple[str, str, str, str], ...] = (
    ("<think>", "</think>", "<think>", "</think>"),
    ("<|channel>thought", "<channel|>", "<|channel>", "<channel|>"),
    ("<seed:think>", "</seed:think>", "<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]", "[THINK]", "[/THINK]"),
    ("◁think▷", "◁/think▷", "◁think▷", "◁/think▷"),
)


def thinking_markers(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The (start, end) text of the model's thinking block, or None if it has none.

    A pair counts when both of its tokens are in the vocabulary, or when the chat
    template spells both markers (families whose markers are ordinary text).
    """
    template = tokenizer.chat_template or ""
    for start, end, start_token, end_token in _MARKERS:
        in_vocab = (tokenizer.token_to_id(start_token) is not None
                    and tokenizer.token_to_id(end_token) is not None)
        if in_vocab or (start in template and end in template):
            return start, end
    return None


def detect_open_think(prompt_text: str, start: str) -> bool:
    """True when the rendered prompt already opened the thinking block (templates
    such as DeepSeek-R1's end the generation prompt with ``<think>\\n``), so the
    model's output starts inside it."""
    return prompt_text.rstrip().endswith(start)


def prompt_opens_thinking(tokenizer: Tokenizer, prompt_ids: Sequence[int], start: str) -> bool:
    """:func:`detect_open_think` on the end of a tokenized prompt (its last 16 tokens,
    decoded: enough for any family's start marker and the blank after it)."""
    return detect_open_think(tokenizer.decode(list(prompt_ids[-16:])), start)


class ReasoningSplitter:
    """Splits streamed text into reasoning and content at the thinking markers.

    ``feed`` returns ``(reasoning_delta, content_delta)``; the markers themselves are
    never returned, and text that might be the start of one is held until it is
    clear. Whitespace that only frames the reasoning (the newlines inside
    ``<think>\n…\n</think>``, and before the answer that follows) is dropped; the
    answer's own whitespace is kept. Several blocks in one output work.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>",
                 starts_inside: bool = False) -> None:
        self.start, self.end = start, end
        self.inside = starts_inside  # the next text is reasoning
        self._buf = ""
        self._ws = ""  # trailing whitespace of the reasoning, held until more follows
        # Drop the leading whitespace of a reasoning section and of the answer after
        # one; an answer with no reasoning before it keeps all of its text.
        self._lstrip = starts_inside
        self._answered = False  # some content has been returned

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` releases (either may be empty)."""
        self._buf += text
        parts = {True: "", False: ""}
        while True:
            marker = self.end if self.inside else self.start
            at = self._buf.find(marker)
            if at < 0:
                cut = len(self._buf) - partial_suffix(self._buf, marker)
                parts[self.inside] += self._section(self._buf[:cut])
                self._buf = self._buf[cut:]
                return parts[True], parts[False]
            parts[self.inside] += self._section(self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self.inside = not self.inside
            self._ws = ""
            self._lstrip = self.inside or not self._answered

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the output (a marker prefix is text)."""
        held, self._buf = self._buf, ""
        text = self._section(held)
        return (text, "") if self.inside else ("", text)

    def _section(self, text: str) -> str:
        if self._lstrip:
            text = text.lstrip()
            self._lstrip = not text
        if not self.inside:
            self._answered = self._answered or bool(text)
            return text
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        return body


class ThinkingBudgetProcessor:
    """An mlx-lm logits processor that ends the thinking block after ``budget`` tokens.

    It counts the tokens generated inside the block (after ``start_ids``, not counting
    the markers); when the count reaches ``budget`` it forces ``end_ids`` one token
    per step (every other logit -inf), then does nothing more. A block the model
    closes by itself ends the count too. ``starts_inside`` says whether the prompt
    opened the block; None reads it from the prompt's last tokens at the first call.
    Only the first block of an output is budgeted.
    """

    _TAIL = 64  # prompt tokens searched for an open block

    def __init__(self, budget: int, start_ids: Sequence[int], end_ids: Sequence[int],
                 starts_inside: bool | None = None) -> None:
        if budget < 0:
            raise InvalidRequestError("thinking_budget must be >= 0.", param="thinking_budget")
        if not start_ids or not end_ids:
            raise ValueError("the thinking markers must encode to at least one token")
        self.budget = budget
        self.start_ids, self.end_ids = list(start_ids), list(end_ids)
        self._starts_inside = starts_inside
        self._tokens = GeneratedTokens()
        self._recent: list[int] = []  # the last generated tokens, for marker matching
        self.state = "outside"  # outside | inside | forcing | done
        self.count = 0  # reasoning tokens generated so far
        self._forced = 0  # end tokens forced so far

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        first = self._tokens.seen is None
        new = self._tokens.update(tokens)
        if first:
            inside = self._starts_inside
            if inside is None:
                inside = self._opened(tokens.reshape(-1)[-self._TAIL :].tolist())
            self.state = "inside" if inside else "outside"
        for token in new:
            self._advance(token)
        if self.state == "inside" and self.count >= self.budget:
            self.state = "forcing"
        if self.state == "forcing":
            return allow_only(logits, [self.end_ids[self._forced]])
        return logits

    def _opened(self, tail: list[int]) -> bool:
        """Whether ``tail`` holds a start marker with no end marker after it."""
        start = _rfind(tail, self.start_ids)
        return start >= 0 and _rfind(tail, self.end_ids) < start

    def _advance(self, token: int) -> None:
        self._recent = (self._recent + [token])[-max(len(self.start_ids), len(self.end_ids)):]
        if self.state == "outside":
            if self._recent[-len(self.start_ids):] == self.start_ids:
                self.state = "inside"
        elif self.state == "inside":
            if self._recent[-len(self.end_ids):] == self.end_ids:
                self.state = "done"
            else:
                self.count += 1
        elif self.state == "forcing":
            self._forced += 1
            if self._forced == len(self.end_ids):
                self.state = "done"


def _rfind(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i : i + len(sub)] == sub:
            return i
    return -1


def make_thinking_budget_processor(
    tokenizer: Tokenizer, budget: int | None, starts_inside: bool | None = None
) -> ThinkingBudgetProcessor | None:
    """A budget processor for one request, or None when there is no budget or the
    model has no thinking markers."""
    markers = thinking_markers(tokenizer) if budget is not None else None
    if markers is None:
        return None
    start, end = (tokenizer.encode(m, add_special_tokens=False) for m in markers)
    return ThinkingBudgetProcessor(budget, start, end, starts_inside)  # type: ignore[arg-type]


# -- template variables ---------------------------------------------------------

# OpenAI effort -> (reasoning_effort for templates that take one, e.g. gpt-oss's
# low/medium/high; enable_thinking for on/off templates, e.g. Qwen 3, Gemma 4).
# "none" and "minimal" turn thinking off where it can be turned off; gpt-oss cannot,
# so they ask it for its least. "xhigh" is the most a template knows: "high".
EFFORTS: dict[str, tuple[str, bool]] = {
    "none": ("low", False),
    "minimal": ("low", False),
    "low": ("low", True),
    "medium": ("medium", True),
    "high": ("high", True),
    "xhigh": ("high", True),
}


def template_kwargs(
    enable_thinking: bool | None = None,
    reasoning_effort: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    profile_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The chat-template variables of one request.

    Layers, later winning: the profile's kwargs; the effort mapped through
    ``EFFORTS`` to ``reasoning_effort`` and ``enable_thinking``; the request's
    ``chat_template_kwargs``; the request's explicit ``enable_thinking``. Raises
    InvalidRequestError for an unknown effort.
    """
    out: dict[str, Any] = dict(profile_kwargs or {})
    effort = reasoning_effort
    if effort is not None:
        if effort not in EFFORTS:
            raise InvalidRequestError(
                f"reasoning_effort {effort!r} is not one of {', '.join(EFFORTS)}.",
                param="reasoning_effort",
            )
        out["reasoning_effort"], out["enable_thinking"] = EFFORTS[effort]
    out.update(chat_template_kwargs or {})
    if enable_thinking is not None:
        out["enable_thinking"] = enable_thinking
    return out
