"""The engine's one way in: a :class:`ChatRequest` becomes a running stream.

:meth:`Engine.start` does everything between a request and its stream, in order:
address and profile resolution (loading the model if needed, off the event loop),
the system prompt, template rendering and tokenization, tool and grammar set-up,
the memory preflight, then submission to the model's worker. Every front end (the
OpenAI and Anthropic routes, ``gmlx run``, ``gmlx estimate``) comes through here, so
a request renders to the same tokens whichever way it arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gmlx.engine import admission, media, threads
from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.media import FetchPolicy, LoadedImage
from gmlx.engine.reasoning import prompt_opens_thinking, template_kwargs
from gmlx.engine.rendering import encode_chat, fold_late_system, template_message
from gmlx.engine.structured import Grammar, compile_format, lark_literal
from gmlx.engine.tools import select_tools, template_tool_choice, template_tools
from gmlx.engine.types import (
    ChatRequest,
    Event,
    FinishReason,
    GenerateRequest,
    PromptImage,
    Tool,
    ToolCall,
    Usage,
)

if TYPE_CHECKING:
    from gmlx.engine.profiles import Profile
    from gmlx.engine.requests import RequestHandle
    from gmlx.engine.residency import Registry, Target
    from gmlx.engine.tokenizer import Tokenizer
    from gmlx.engine.worker import ModelWorker

# A prompt this short (characters of message content) renders and tokenizes on the
# event loop: about 0.3-0.7 ms on a slow CPU, which a hop to a worker thread would only
# lengthen. Longer ones go off the loop, where the tokenizer lets go of the GIL while it
# works, so the streams the loop serves keep going meanwhile.
INLINE_CHARS = 1024


@dataclass
class Job:
    """A submitted request and what its responses echo back."""

    handle: RequestHandle
    model: str  # the name the response reports: what the request asked for, else the id
    prompt_tokens: int
    created: int
    tokenizer: Tokenizer | None = None  # names the alternatives of top_logprobs

    @property
    def id(self) -> str:
        """The engine request id without its ``req-`` prefix, for protocol ids."""
        return self.handle.id.removeprefix("req-")


@dataclass
class Result:
    """A finished request, collected."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tokens: list[Event] = field(default_factory=list)  # events that carry a token (logprobs)


@dataclass(frozen=True)
class Rendered:
    """A request rendered and tokenized for the model it addressed."""

    worker: ModelWorker
    profile: Profile
    model: str  # the name responses report
    ids: list[int]
    forced_tool: bool = False  # the request requires a tool call
    tools: tuple[Tool, ...] = ()  # the tools the template showed the model
    tool_dicts: tuple[Mapping[str, Any], ...] = ()  # the same, as the template took them
    images: tuple[PromptImage, ...] = ()  # the prompt's images, one per image run

    @property
    def cache_ids(self) -> list[int]:
        """What the prompt cache files this prompt under: its ids, with image runs
        keyed by their images' digests."""
        if not self.images or self.worker.loaded.vision is None:
            return self.ids
        from gmlx.engine.vision.prefill import cache_key

        return cache_key(self.worker.loaded.vision, self.ids, self.images)


Images = list[tuple[str, LoadedImage]]  # a request's images, read, with where each was


class Engine:
    """The engine behind every front end: one :class:`Registry` of models, and what
    each request needs beyond its model (the memory preflight switch, the cap on
    logprob alternatives).

    Args:
        registry: the served models.
        preflight_mem: refuse before submitting a request that cannot fit in memory.
        top_logprobs_cap: most ``top_logprobs`` alternatives a request gets (0..20).
        fetch_policy: how far the server goes to read a request's image URLs.
    """

    def __init__(
        self, registry: Registry, *, preflight_mem: bool = True, top_logprobs_cap: int = 0,
        fetch_policy: FetchPolicy = media.DEFAULT_POLICY,
    ) -> None:
        self.registry = registry
        self.preflight_mem = preflight_mem
        self.top_logprobs_cap = top_logprobs_cap
        self.fetch_policy = fetch_policy

    # -- rendering --------------------------------------------------------------

    async def render(self, req: ChatRequest, *, use: bool = False) -> Rendered:
        """Resolve the request's model (loading it off the loop if needed) and profile,
        and render and tokenize it (off the loop when it is long). ``use`` marks the
        model used now (a generation; not an estimate), so no idle unload or eviction
        takes it before the request is submitted."""
        return await self._render_for(req, *await self.address(req), use)

    async def address(self, req: ChatRequest) -> tuple[Target, Images]:
        """The model and profile a request addresses and its images, after checking
        what can be checked without loading the model: the tool choice, and the images
        (read off the loop: fetching one blocks on the network)."""
        target = self.registry.address(req.model, req.profile)
        select_tools(req.tools, req.tool_choice)
        images: Images = []
        if media.image_parts(req.messages):
            images = await asyncio.to_thread(media.load_images, req.messages, self.fetch_policy)
        return target, images

    async def _render_for(self, req: ChatRequest, target: Target, images: Images,
                          use: bool) -> Rendered:
        worker = self.registry.running(target.spec.id)
        if worker is None:  # loading blocks for seconds: off the loop (a load marks it used)
            worker = await threads.run(self.registry.worker, target.spec.id)
        elif use:
            self.registry.touch(target.spec.id)
        if _content_chars(req) <= INLINE_CHARS and not req.tools and not images:
            return self._render(req, target, worker, images)
        return await asyncio.to_thread(self._render, req, target, worker, images)

    def render_sync(self, req: ChatRequest) -> Rendered:
        """:meth:`render` for a caller without an event loop (the CLI); marks the model used."""
        target = self.registry.address(req.model, req.profile)
        select_tools(req.tools, req.tool_choice)
        images = media.load_images(req.messages, self.fetch_policy)
        return self._render(req, target, self.registry.worker(target.spec.id), images)

    def _render(self, req: ChatRequest, target: Target, worker: ModelWorker,
                images: Images) -> Rendered:
        profile = self.registry.profile(target, worker.loaded)
        tokenizer = worker.loaded.tokenizer
        model = req.model or target.spec.id
        if req.prompt is not None:
            return Rendered(worker, profile, model, tokenizer.encode(req.prompt))
        vision = worker.loaded.vision
        if images and vision is None:  # the one place the engine refuses an image
            raise media.text_only(images[0][0], model)
        tools, forced = select_tools(req.tools, req.tool_choice)
        messages = [template_message(m, with_images=vision is not None) for m in req.messages]
        if profile.system and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": profile.system})
        kwargs = template_kwargs(
            req.reasoning.enabled, req.reasoning.effort, req.template_kwargs,
            profile.chat_template_kwargs,
        )
        if (choice := template_tool_choice(req.tool_choice)) is not None:
            kwargs["tool_choice"] = choice
        tool_dicts = template_tools(tools)
        try:
            ids = encode_chat(tokenizer, messages, tool_dicts, kwargs)
        except InvalidRequestError:
            # Many templates (Qwen 3's, Gemma's, Mistral's) raise for a system message
            # that is not first; agents send them mid-conversation (Claude Code does).
            if (folded := fold_late_system(messages)) is None:
                raise
            ids = encode_chat(tokenizer, folded, tool_dicts, kwargs)
        prompt_images: tuple[PromptImage, ...] = ()
        if images:
            assert vision is not None
            ids = vision.expand(ids, len(images))
            prompt_images = tuple(PromptImage(image.sha256, vision.pixels(image))
                                  for _, image in images)
        return Rendered(worker, profile, model, ids, forced, tools, tuple(tool_dicts or ()),
                        prompt_images)

    # -- starting -----------------------------------------------------------------

    async def start(self, req: ChatRequest) -> Job:
        """Submit one request to its model's worker; its events stream from the job's
        handle. Raises GmlxError (unknown model or profile, a prompt too long for the
        context or the memory, bad sampling values or schema, a full queue, a model
        that fails to load) before anything is streamed.
        """
        grammar = compile_format(req.response_format)  # a bad schema fails before any load
        r = await self.render(req, use=True)
        grammar = self._answer_grammar(req, r, grammar)
        if grammar is not None:  # the first structured request builds the vocabulary index
            from gmlx.engine.structured import llg_tokenizer

            await asyncio.to_thread(llg_tokenizer, r.worker.loaded.tokenizer)
        return self._submit(req, r, grammar)

    def start_sync(self, req: ChatRequest) -> Job:
        """:meth:`start` for a caller without an event loop (the CLI)."""
        grammar = compile_format(req.response_format)
        r = self.render_sync(req)
        return self._submit(req, r, self._answer_grammar(req, r, grammar))

    def _answer_grammar(self, req: ChatRequest, r: Rendered, grammar: Grammar | None) -> Grammar | None:
        """The grammar the answer follows: the response format's, else a required tool
        call's where the call syntax allows a grammar.

        A prompt that leaves a thinking block open (thinking on) gets a grammar that
        closes the block first: the JSON or the call must be the answer, not reasoning
        text. The prompt is not re-rendered with thinking off instead, because templates
        such as DeepSeek-R1's open the block whatever the variables say.
        """
        close = self._open_thinking(r) if grammar is not None or r.forced_tool else None
        if grammar is not None:
            if close is None:
                return grammar
            tokenizer = r.worker.loaded.tokenizer
            return compile_format(req.response_format, lark_literal(tokenizer, close))
        if not r.forced_tool:
            return None
        from gmlx.engine.tools import forced_call_grammar

        return forced_call_grammar(r.worker.tool_parser, r.worker.loaded.tokenizer, r.tools, close)

    @staticmethod
    def _open_thinking(r: Rendered) -> str | None:
        """The end marker of the thinking block the rendered prompt leaves open, if any."""
        if (markers := r.worker.think_markers) is None:
            return None
        opened = prompt_opens_thinking(r.worker.loaded.tokenizer, r.ids, markers[0])
        return markers[1] if opened else None

    def resident(self, req: ChatRequest) -> bool:
        """Whether the model the request addresses is loaded now (a request to one that
        is not waits for its load). Raises the addressing errors."""
        return self.registry.resident(self.registry.address(req.model, req.profile).spec.id)

    def _submit(self, req: ChatRequest, r: Rendered, grammar: Grammar | None) -> Job:
        self.registry.touch(r.worker.loaded.id)  # a request: the model is in use
        if self.preflight_mem:
            admission.preflight(self.registry, r.worker, r.ids, req.max_tokens, r.cache_ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else r.profile.max_tokens
        if max_tokens is None:  # unset everywhere: whatever the context window leaves
            max_tokens = max(1, r.worker.loaded.context_length - len(r.ids))
        chat = req.prompt is None
        handle = r.worker.submit(
            GenerateRequest(
                tuple(r.ids),
                max_tokens=max_tokens,
                sampling=r.profile.sampling_params(req.sampling),
                stop=req.stop if req.stop else r.profile.stop,
                id=req.id,
                logprobs=req.logprobs,
                top_logprobs=min(req.top_logprobs, self.top_logprobs_cap) if req.logprobs else 0,
                grammar=grammar,
                tools=r.tool_dicts or None,
                tool_choice_forced=r.forced_tool,
                split_reasoning=chat,
                thinking_budget=req.reasoning.budget,
                images=r.images,
            )
        )
        return Job(handle, r.model, len(r.ids), int(time.time()), r.worker.loaded.tokenizer)

    # -- answers without generating ------------------------------------------------

    async def count_tokens(self, req: ChatRequest) -> int:
        """The prompt tokens the request renders to on its model (loading it if needed)."""
        return len((await self.render(req)).ids)

    async def estimate(self, req: ChatRequest) -> admission.Estimate:
        """The admission estimate of a request. Never loads a model: one that is not
        resident answers ``resident: false`` with nothing counted. Raises the
        addressing errors ``start`` raises."""
        target, images = await self.address(req)  # a bad tool choice or image: refused either way
        if not self.registry.resident(target.spec.id):
            return admission.not_resident(
                req.model or target.spec.id, req.max_tokens, target.spec.max_kv_size
            )
        r = await self._render_for(req, target, images, use=False)
        return admission.estimate(self.registry, r.worker, r.ids, req.max_tokens, r.model,
                                  r.cache_ids)

    def estimate_sync(self, req: ChatRequest) -> admission.Estimate:
        """:meth:`estimate` for a caller without an event loop, loading the model."""
        r = self.render_sync(req)
        return admission.estimate(self.registry, r.worker, r.ids, req.max_tokens, r.model,
                                  r.cache_ids)


async def collect(job: Job) -> Result:
    """Wait for the whole answer. A shed request raises its error (a whole response
    has no stream to carry it in); a failed one raises as its handle does."""
    parts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    tokens: list[Event] = []
    async for ev in job.handle:
        parts.append(ev.text)
        reasoning.append(ev.reasoning)
        calls.extend(ev.tool_calls)
        if ev.token_ids:
            tokens.append(ev)
        if ev.final:
            assert ev.finish_reason is not None and ev.usage is not None
            if ev.finish_reason is FinishReason.SHED and ev.error is not None:
                raise ev.error
            return Result("".join(parts), ev.finish_reason, ev.usage, ev.stop_sequence,
                          "".join(reasoning), calls, tokens)
    raise AssertionError("a request stream ended without a final event")


def _content_chars(req: ChatRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    return sum(len(m.content) for m in req.messages)
