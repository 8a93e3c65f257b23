"""Engine types: what front ends hand to the engine and what they get back."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gmlx.engine.errors import GmlxError
    from gmlx.engine.structured import Grammar
    from gmlx.engine.tools import ToolCall


class FinishReason(StrEnum):
    """Why a request stopped generating."""

    STOP = "stop"  # EOS or a stop string
    TOOL_CALLS = "tool_calls"  # the model stopped after calling tools
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # client disconnect or cancel route
    ERROR = "error"  # the engine failed; the event carries the error
    SHED = "shed"  # the memory governor ended it; the event carries the error


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. Defaults change nothing (plain softmax sampling)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    seed: int | None = None
    logit_bias: Mapping[int, float] | None = None
    top_n_sigma: float = 0.0  # keep logits within n standard deviations of the max (0: off)
    typical_p: float = 1.0  # locally typical sampling mass (1: off)
    xtc_probability: float = 0.0  # chance per step to exclude the top choices (0: off)
    xtc_threshold: float = 0.1  # XTC excludes tokens at or above this probability
    p_less: bool = False  # keep tokens at least as likely as the collision probability

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: a tokenized prompt and how to continue it."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    id: str = field(default_factory=new_request_id)
    logprobs: bool = False  # report each generated token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives (0..20)
    grammar: Grammar | None = None  # constrain the output (structured output)
    tools: tuple[Mapping[str, Any], ...] | None = None  # parse tool calls out of the text
    tool_choice_forced: bool = False  # a call was required: warn when none comes
    split_reasoning: bool = False  # separate <think> blocks into Event.reasoning
    thinking_budget: int | None = None  # close the thinking block after this many tokens


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Event:
    """A piece of a request's output.

    Text events carry ``text`` (never a broken UTF-8 character, never part of a stop
    string) and the ids of the tokens that produced it. The last event of a request
    carries ``finish_reason`` and ``usage``; an ``ERROR`` finish also carries ``error``,
    and a finish caused by a stop string names it in ``stop_sequence``.
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: GmlxError | None = None
    stop_sequence: str | None = None  # the stop string that ended a ``stop`` finish, if any
    cache_tier: str | None = None  # on the final event: the prompt-cache tier the request hit
    reasoning: str = ""  # with ``split_reasoning``: text inside the thinking block
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed by this event's text
    logprob: float | None = None  # with ``logprobs``: the log-probability of ``token_ids[0]``
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first

    @property
    def final(self) -> bool:
        return self.finish_reason is not None
