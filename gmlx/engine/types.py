"""Engine types: what front ends hand to the engine and what they get back.

A front end turns its input into a :class:`ChatRequest` (a protocol-neutral
conversation, or a raw text prompt, and how to answer it), hands it to
:class:`gmlx.engine.chat.Engine`, and renders the :class:`Event` objects it gets back.
No type here knows a protocol's field names.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gmlx.engine.errors import GmlxError


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


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar (its serialized form) and where it came from
    (``gmlx.engine.structured`` compiles one)."""

    text: str  # llguidance's grammar JSON, ready for LLMatcher
    kind: str  # "json_object" or "json_schema"
    name: str | None = None  # the schema's name, when the request gave one


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class PromptImage:
    """An image of a tokenized prompt, ready for its model's vision tower: the digest
    of its bytes (what the prompt cache keys it by) and its pixels as the tower reads
    them (a float32 array, channels first)."""

    sha256: str
    pixels: Any = field(repr=False, compare=False)


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
    images: tuple[PromptImage, ...] = ()  # one per image run of the prompt, in order


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


# -- the conversation a front end hands to the engine ------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One tool call: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image in a message: a ``data:`` URI or an ``http(s)://`` URL. A vision model
    reads it where it stands among the message's parts; a text-only one refuses it."""

    url: str
    detail: str | None = None
    where: str | None = None  # where the client put it (an error names it), if not messages[i].content[j]


Part = TextPart | ImagePart

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    """One turn of a conversation.

    ``parts`` is the content; an assistant turn may carry ``tool_calls`` (and the
    ``reasoning`` it wrote before answering), a ``tool`` turn is the result of the
    call ``tool_call_id``. ``name`` is the participant or tool name, when given.
    """

    role: str  # one of ROLES
    parts: tuple[Part, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None

    @classmethod
    def text(cls, role: str, text: str, **fields: Any) -> Message:
        return cls(role, (TextPart(text),) if text else (), **fields)

    @property
    def content(self) -> str:
        """The text parts joined (images have no text)."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and JSON-schema
    parameters; ``extra`` holds any other fields the client gave the function (the
    chat template sees them)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


class ToolChoiceMode(StrEnum):
    AUTO = "auto"  # the model decides
    NONE = "none"  # no tool may be called: the tools are not shown to the model
    REQUIRED = "required"  # some tool must be called
    NAMED = "named"  # the tool ``ToolChoice.name`` must be called


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # with NAMED


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: ``json_schema`` (JSON valid against ``schema``) or
    ``json_object`` (any JSON object). ``field`` names the request field it came
    from, for error messages."""

    kind: str = "json_schema"  # or "json_object"
    schema: Any = None  # the JSON schema, as the client sent it (checked when compiled)
    name: str | None = None
    field: str = "response_format"


@dataclass(frozen=True)
class Reasoning:
    """Reasoning controls: think or not (None: the template's default), an effort
    (one of ``reasoning.EFFORTS``), and a budget of thinking tokens."""

    enabled: bool | None = None
    effort: str | None = None
    budget: int | None = None


@dataclass(frozen=True)
class ChatRequest:
    """Everything between a front end and a running stream, protocol-neutral.

    ``model`` is an address (an id, an alias, ``id@profile``, or empty for the
    default model). Either ``messages`` (rendered through the model's chat template)
    or ``prompt`` (raw text, no template) is set. ``sampling`` holds the
    :class:`SamplingParams` fields the request sets explicitly (they override the
    profile); ``max_tokens`` and ``stop`` left None take the profile's.
    """

    model: str = ""
    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    profile: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    response_format: ResponseFormat | None = None
    reasoning: Reasoning = field(default_factory=Reasoning)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_request_id)
