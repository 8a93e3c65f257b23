"""A request's token-to-text pipeline: the chain that turns generated tokens into events.

    token -+-> Detokenize -> StopStrings -> SplitReasoning -+-> SplitToolCalls -+-> Event
           |                                   (reasoning) +-> SplitToolCalls -+
           +-> Logprobs ---------------------------------------------------------+

As mlx-lm chains its generators (``generate_step`` yields tokens, ``stream_generate``
wraps them), each step here is small, does one thing and can be fed on its own; the
work itself is done by the classes the steps wrap (``IncrementalDetokenizer``,
``StopMatcher``, ``ReasoningSplitter``, ``ToolCallStream``, ``token_logprobs``). Calls
are split out of the reasoning too: a model that writes a complete call before it
closes its thinking block still made a call. A
request owns its :class:`TextPipeline`; the worker feeds it each token the generator
returns and emits the :class:`Event` it hands back.

Every step has ``feed`` (the next piece) and ``finish`` (the output ended: what the
step still holds). Where a worker's own methods already have that shape they are the
step's, bound once: a token costs no call beyond the work. The optional steps are
absent (not no-ops) when a request does not ask for them, so a plain request pays
only for detokenizing and stop strings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from gmlx.engine.reasoning import ReasoningSplitter
from gmlx.engine.stats import token_logprobs
from gmlx.engine.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer
from gmlx.engine.tools import Item, ToolCallStream, ToolParser
from gmlx.engine.types import Event, FinishReason, GenerateRequest, ToolCall

__all__ = [
    "Detokenize",
    "Logprobs",
    "SplitReasoning",
    "SplitToolCalls",
    "StopStrings",
    "TextPipeline",
    "pipeline_for",
]

log = logging.getLogger("gmlx.engine")

TopLogprobs = tuple[tuple[int, float], ...]
Calls = tuple[ToolCall, ...]


class Detokenize:
    """Step 1: token ids to text deltas that never split a character.

    ``feed(token)`` returns the text the token completes (possibly none);
    ``finish()`` the characters still held (an incomplete one as U+FFFD)."""

    __slots__ = ("feed", "finish")

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.feed: Callable[[int], str] = detokenizer.add
        self.finish: Callable[[], str] = detokenizer.flush


class StopStrings:
    """Step 2: the text up to the first stop string, never any part of one.

    ``feed(text)`` returns the text safe to release and whether a stop string ended
    the output; ``finish()`` the text held as a possible stop (none after a stop)."""

    __slots__ = ("_matcher", "feed", "finish")

    def __init__(self, stops: Iterable[str]) -> None:
        self._matcher = StopMatcher(stops)
        self.feed: Callable[[str], tuple[str, bool]] = self._matcher.feed
        self.finish: Callable[[], str] = self._matcher.flush

    @property
    def matched(self) -> str | None:
        """The stop string that was met, if one was."""
        return self._matcher.matched


class SplitReasoning:
    """Step 3: thinking-block text apart from the answer.

    ``feed(text)`` and ``finish()`` return ``(reasoning, content)``: what ``text``
    releases, and at the end what is held (a marker's start is text after all)."""

    __slots__ = ("feed", "finish")

    def __init__(self, splitter: ReasoningSplitter) -> None:
        self.feed: Callable[[str], tuple[str, str]] = splitter.feed
        self.finish: Callable[[], tuple[str, str]] = splitter.finish


class SplitToolCalls:
    """Step 4: completed tool calls out of the content.

    ``feed(text)`` and ``finish()`` return ``(content, calls)``: the calls ``text``
    completes and the text around them, and at the end whatever is held (a call
    whose end marker never came is still a call when it parses)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: ToolCallStream) -> None:
        self._stream = stream

    @property
    def called(self) -> bool:
        """Whether the output has made a call so far."""
        return bool(self._stream.calls)

    def feed(self, text: str) -> tuple[str, Calls]:
        return _split_items(self._stream.feed(text))

    def finish(self) -> tuple[str, Calls]:
        return _split_items(self._stream.finish())


def _split_items(items: list[Item]) -> tuple[str, Calls]:
    content = "".join(i for i in items if isinstance(i, str))
    return content, tuple(i for i in items if not isinstance(i, str))


class Logprobs:
    """Beside the chain: the sampled token's log-probability and the ``top`` most
    likely alternatives. ``feed(token, row)`` takes the step's log-probabilities over
    the vocabulary (evaluated)."""

    __slots__ = ("top",)

    def __init__(self, top: int) -> None:
        self.top = top

    def feed(self, token: int, row: Any) -> tuple[float, TopLogprobs]:
        return token_logprobs(token, row, self.top)


class TextPipeline:
    """One request's chain of steps, from each generated token to the event it makes.

    Args:
        request_id: the id the events carry.
        detokenize, stops: the steps every request has.
        reasoning, tools, logprobs: the steps a request may ask for (None: absent).
        reasoning_tools: tool calls split out of the reasoning (None: absent).
        call_required: a tool call was required: warn when the output ends without one.
    """

    def __init__(
        self,
        request_id: str,
        detokenize: Detokenize,
        stops: StopStrings,
        *,
        reasoning: SplitReasoning | None = None,
        tools: SplitToolCalls | None = None,
        reasoning_tools: SplitToolCalls | None = None,
        logprobs: Logprobs | None = None,
        call_required: bool = False,
    ) -> None:
        self.request_id = request_id
        self.detokenize = detokenize
        self.stops = stops
        self.reasoning = reasoning
        self.tools = tools
        self.reasoning_tools = reasoning_tools
        self.logprobs = logprobs
        self.call_required = call_required
        self.finish: FinishReason | None = None  # set when a fed token ended the output
        # Bound once: every generated token passes through these two.
        self._detokenize = detokenize.feed
        self._stop = stops.feed

    @property
    def called(self) -> bool:
        """Whether the output has made a tool call so far (in its answer or its reasoning)."""
        return any(step is not None and step.called for step in (self.tools, self.reasoning_tools))

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self.stops.matched

    def feed(self, token: int | None, logprobs: Any = None, end: str | None = None) -> Event | None:
        """Run one generated token down the chain.

        Args:
            token: the token, or None when it adds no text and no token id (an
                end-of-sequence token, or one whose text went out already).
            logprobs: the step's log-probabilities over the vocabulary, for ``token``.
            end: how the generator ended the output with this token: ``"stop"``
                (end of sequence) or ``"length"`` (max tokens); None while it goes on.

        Returns the event to emit, or None when the token released nothing. Sets
        ``finish`` when the output ended: ``STOP`` (end of sequence or a stop string;
        ``TOOL_CALLS`` when the output made a call), or ``LENGTH``.
        """
        ended = end is not None
        text = "" if token is None else self._detokenize(token)
        if ended:
            text += self.detokenize.finish()
        text, stopped = self._stop(text)
        finish: FinishReason | None = None
        if stopped:
            finish = FinishReason.STOP
        elif ended:
            text += self.stops.finish()
            finish = FinishReason.STOP if end == FinishReason.STOP else FinishReason.LENGTH
        final = finish is not None
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if final:
                more_reasoning, more_text = self.reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls: Calls = ()
        if self.reasoning_tools is not None and (reasoning or final):
            reasoning, calls = self.reasoning_tools.feed(reasoning)
            if final:
                more_reasoning, more_calls = self.reasoning_tools.finish()
                reasoning, calls = reasoning + more_reasoning, calls + more_calls
        if self.tools is not None:
            text, content_calls = self.tools.feed(text)
            if final:
                more_text, more_calls = self.tools.finish()
                text, content_calls = text + more_text, content_calls + more_calls
            calls += content_calls
            if finish is FinishReason.STOP and self.called:
                finish = FinishReason.TOOL_CALLS
        if final and self.call_required and not self.called:
            log.warning("%s: a tool call was required but the model made none", self.request_id)
        self.finish = finish
        if token is None:
            if not (text or reasoning or calls):
                return None
            return Event(self.request_id, text=text, reasoning=reasoning, tool_calls=calls)
        logprob, top = self.logprobs.feed(token, logprobs) if self.logprobs is not None else (None, ())
        return Event(
            self.request_id, text=text, token_ids=(token,), reasoning=reasoning,
            tool_calls=calls, logprob=logprob, top_logprobs=top,
        )


def pipeline_for(
    request: GenerateRequest,
    tokenizer: Tokenizer,
    *,
    think_markers: tuple[str, str] | None = None,
    starts_inside: bool = False,
    tool_parser: ToolParser | None = None,
) -> TextPipeline:
    """The chain ``request`` asks for: reasoning split out when it asks and the model
    has thinking markers (``starts_inside``: the prompt left a thinking block open),
    tool calls (out of the answer and the reasoning) when it passes tools and the
    model has a call syntax, logprobs when it asks for them."""
    reasoning = None
    if think_markers and request.split_reasoning:
        reasoning = SplitReasoning(ReasoningSplitter(*think_markers, starts_inside=starts_inside))
    tools = reasoning_tools = None
    if request.tools and tool_parser is not None:
        tools = SplitToolCalls(ToolCallStream(tool_parser, request.tools))
        # Only a call with both markers is taken out of reasoning: a syntax that runs
        # to the end of the output, or a bare answer, cannot be told from thinking.
        if reasoning is not None and tool_parser.start and tool_parser.end:
            parser = replace(tool_parser, bare=None)
            reasoning_tools = SplitToolCalls(ToolCallStream(parser, request.tools))
    return TextPipeline(
        request.id,
        Detokenize(tokenizer.detokenizer()),
        StopStrings(request.stop),
        reasoning=reasoning,
        tools=tools,
        reasoning_tools=reasoning_tools,
        logprobs=Logprobs(request.top_logprobs) if request.logprobs else None,
        call_required=request.tool_choice_forced,
    )
