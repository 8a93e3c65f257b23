"""Tool calls: the parser chosen from the chat template, a streaming splitter, tool_choice.

mlx-lm's ``tool_parsers`` modules know the call syntax of most template families
(each names its ``tool_call_start``/``tool_call_end`` markers and a
``parse_tool_call(text, tools)``); gmlx picks one with mlx-lm's own inference and
adds the families it misses: Hermes-style templates that do not spell
``tool_call.name``, Llama 3 JSON (``<|python_tag|>`` or a bare JSON answer) and bare
pythonic lists (``[f(a=1)]``). :class:`ToolCallStream` turns the model's text deltas
into plain text and completed :class:`ToolCall` items as they stream.
"""

from __future__ import annotations

import importlib
import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.tokenizer import Tokenizer, partial_suffix
from gmlx.engine.types import Tool, ToolCall, ToolChoice, ToolChoiceMode

log = logging.getLogger("gmlx.engine")

Tools = Sequence[Tool]
# mlx-lm's parser signature: a dict or a list of dicts with "name" and "arguments";
# raises (ValueError, JSONDecodeError, ...) on text that is not a call.
ParseFn = Callable[[str, Any], Any]


Item = str | ToolCall  # what ToolCallStream yields: text to emit, or a completed call


@dataclass(frozen=True)
class ToolParser:
    """One template family's call syntax.

    A call is ``start`` + body + ``end``; an empty ``end`` means the call runs to the
    end of the output (Mistral, Llama 3). ``bare`` is for families whose model may
    answer with a call and no marker: an output that opens (after whitespace) with
    this text is parsed whole at the end, and kept as text if it is not a call.
    """

    name: str
    start: str
    end: str
    parse: ParseFn
    bare: str | None = None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- the families mlx-lm does not infer ------------------------------------------------


def _parse_json_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """One or more JSON call objects, separated by whitespace or ``;`` (Llama 3)."""
    decoder = json.JSONDecoder()
    calls, pos, text = [], 0, text.strip()
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise TypeError(f"not a tool call: {value!r}")
        calls.append(value)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    if not calls:
        raise ValueError("no tool call")
    return calls


def _parse_bare_pythonic(text: str, tools: Any = None) -> Any:
    from mlx_lm.tool_parsers import pythonic

    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        raise ValueError("not a pythonic call list")
    return pythonic.parse_tool_call(stripped, tools)


def _mlx_lm_parser(name: str) -> ToolParser:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolParser(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def tool_parser_for(tokenizer: Tokenizer) -> ToolParser | None:
    """The call syntax the model's chat template teaches, or None when it has none.

    mlx-lm's inference runs first; then Hermes ``<tool_call>`` JSON, Llama 3 JSON and
    bare pythonic lists are recognised from the template text.
    """
    from gmlx.engine.mlxlm import infer_tool_parser

    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        return None
    try:
        name = infer_tool_parser(tokenizer.hf)
    except Exception:  # a private helper: never let it break a request
        log.debug("mlx-lm tool-parser inference failed", exc_info=True)
        name = None
    if name is not None:
        return _mlx_lm_parser(name)
    if "<tool_call>" in template:
        return _mlx_lm_parser("json_tools")
    if "[func_name1(" in template or "[func_name(" in template:
        # Llama 3.2/4 pythonic templates: the whole answer is "[f(a=1), g(b=2)]".
        return ToolParser("pythonic_bare", "", "", _parse_bare_pythonic, bare="[")
    if "<|start_header_id|>" in template and (
        "<|python_tag|>" in template or '"parameters"' in template
    ):
        return ToolParser("llama3_json", "<|python_tag|>", "", _parse_json_calls, bare="{")
    return None


# -- turning parser output into ToolCalls ------------------------------------------


def _to_calls(parsed: Any, raw: str = "") -> list[ToolCall]:
    """ToolCalls from a parser's dict/list; raises TypeError/ValueError for anything
    else. ``raw`` is the call's text as the model wrote it (see :func:`_arguments_text`)."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise ValueError("no tool call")
    calls = []
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise TypeError(f"not a tool call: {item!r}")
        args = item.get("arguments", item.get("parameters", {}))
        own = args.strip() if isinstance(args, str) else None
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(args, Mapping):
            raise TypeError(f"tool call arguments are not an object: {args!r}")
        call_id = item["id"] if isinstance(item.get("id"), str) else new_call_id()
        calls.append(ToolCall(call_id, item["name"], _arguments_text(args, own or raw)))
    return calls


def _arguments_text(args: Mapping[str, Any], raw: str) -> str:
    """The arguments as JSON text, never anything JSON does not allow.

    They are written anew (one spelling whatever the syntax), but a number beyond a
    double's range (``1e999``) parsed to infinity, which JSON cannot write: then the
    model's own text of the arguments is kept, found in ``raw`` (the call's text, or
    the arguments string itself), when it is strict JSON of the same value. Raises
    ValueError when there is none (NaN, or a syntax that is not JSON): the call is
    not one a client could parse.
    """
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        pass
    decoder = json.JSONDecoder(parse_constant=_no_constant)  # NaN / Infinity are not JSON
    at = raw.find("{")
    while at >= 0:
        try:
            value, end = decoder.raw_decode(raw, at)
        except ValueError:
            value, end = None, at
        if value == args:
            return raw[at:end]
        at = raw.find("{", at + 1)
    raise ValueError("tool call arguments hold a number that JSON cannot write")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class ToolCallStream:
    """Splits streamed model text into plain text and completed tool calls.

    ``feed`` takes each text delta and returns what is safe to emit now: text that
    cannot be part of a call marker, and calls whose end marker arrived. Text that
    might begin a marker is held until it is clear, a call body is held until it is
    complete, and ``finish`` releases the rest. A call that does not parse comes out
    as its original text (markers included): nothing the model wrote is lost, except
    whitespace next to a call (the blank lines around and between calls).
    """

    def __init__(self, parser: ToolParser, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.parser = parser
        self.tools = list(tools) if tools else None
        self.calls: list[ToolCall] = []  # every call produced so far
        self._buf = ""  # held text: a possible marker prefix, or a call body
        self._mode = "text"  # "text" | "call" (inside markers) | "bare" (whole output)
        self._at_start = parser.bare is not None  # nothing but whitespace seen yet
        self._after_call = False
        self._ws = ""  # whitespace held after the last text

    def feed(self, text: str) -> list[Item]:
        """The items that ``text`` completes (possibly none)."""
        self._buf += text
        out: list[Item] = []
        while True:
            if self._mode == "bare" or (self._mode == "call" and not self.parser.end):
                return out  # these run to the end of the output
            if self._mode == "call":
                end = self._buf.find(self.parser.end)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.parser.end) :]
                self._mode = "text"
                out += self._complete(body, self.parser.start + body + self.parser.end)
                continue
            if self._at_start:
                head = self._buf.lstrip()
                if not head:
                    return out
                self._at_start = False
                if head.startswith(self.parser.bare):  # type: ignore[arg-type]
                    self._mode = "bare"
                    return out
            start = self._buf.find(self.parser.start) if self.parser.start else -1
            if start >= 0:
                self._text(out, self._buf[:start])
                self._buf = self._buf[start + len(self.parser.start) :]
                self._mode = "call"
                continue
            keep = partial_suffix(self._buf, self.parser.start) if self.parser.start else 0
            cut = len(self._buf) - keep
            self._text(out, self._buf[:cut])
            self._buf = self._buf[cut:]
            return out

    def finish(self) -> list[Item]:
        """Everything still held, at the end of the output. A call whose end marker
        never came is still a call when its body parses (the model stopped at EOS)."""
        out: list[Item] = []
        buf, mode, self._buf, self._mode = self._buf, self._mode, "", "text"
        if mode == "call":
            out += self._complete(buf, self.parser.start + buf)
        elif mode == "bare":
            out += self._complete(buf, buf)
        else:
            self._text(out, buf)
        if self._ws and not self.calls:
            out.append(self._ws)
        self._ws = ""
        return out

    def _complete(self, body: str, raw: str) -> list[Item]:
        try:
            calls = _to_calls(self.parser.parse(body, self.tools), body)
        except Exception as e:  # noqa: BLE001 - parsers raise many types on bad text
            log.info("unparsable %s tool call kept as text: %s", self.parser.name, e)
            out: list[Item] = []
            self._text(out, raw)
            return out
        self.calls += calls
        self._ws = ""
        self._after_call = True
        return list(calls)

    def _text(self, out: list[Item], text: str) -> None:
        # Trailing whitespace waits for what follows: more text releases it, a call
        # drops it, so a reply made only of calls has no blank content.
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if self._after_call:
            body = body.lstrip()
        if body:
            out.append(body)
            self._after_call = False


# -- tool_choice ------------------------------------------------------------------


def select_tools(tools: Tools, choice: ToolChoice) -> tuple[tuple[Tool, ...], bool]:
    """The tools the template should see under ``choice``, and whether a call is forced.

    ``none`` hides them all, so the model cannot call one; ``auto`` shows them;
    ``required`` shows them and forces a call; ``named`` shows only that tool and
    forces it. Forcing is the template's business (or a grammar's, where the call
    syntax allows one). Raises InvalidRequestError (param ``tool_choice``) for a
    forced choice without tools or a named tool that is not among them.
    """
    if choice.mode is ToolChoiceMode.NONE:
        return (), False
    if choice.mode is ToolChoiceMode.AUTO:
        return tuple(tools), False
    if choice.mode is ToolChoiceMode.REQUIRED:
        if not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools.", param="tool_choice")
        return tuple(tools), True
    named = tuple(t for t in tools if t.name == choice.name)
    if not named:
        raise InvalidRequestError(
            f"tool_choice names {choice.name!r}, which is not among the tools.",
            param="tool_choice",
        )
    return named, True


def template_tools(tools: Tools) -> list[dict[str, Any]] | None:
    """Tools in the function shape chat templates expect (None: no tools)."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = dict(tool.parameters)
        out.append({"type": "function", "function": {**function, **tool.extra}})
    return out or None


def template_tool_choice(choice: ToolChoice) -> Any:
    """The ``tool_choice`` template variable of a forced choice (None otherwise):
    templates that implement forcing read ``"required"`` or a named function."""
    if choice.mode is ToolChoiceMode.REQUIRED:
        return "required"
    if choice.mode is ToolChoiceMode.NAMED:
        return {"type": "function", "function": {"name": choice.name}}
    return None


# -- forcing a call -----------------------------------------------------------------

# Lenient: a keyword llguidance does not implement (``propertyNames``, in Claude Code's
# tools) is left unenforced rather than failing the whole grammar, which would leave
# the call unforced; the client checks the arguments against its schema anyway.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                 "lenient": True}


def forced_call_grammar(
    parser: ToolParser | None, tokenizer: Tokenizer, tools: Tools, close_thinking: str | None = None
) -> Any:
    """A grammar that makes the model write exactly one call to one of ``tools``, in
    the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` syntax, with the
    arguments following the tool's parameter schema.

    ``close_thinking`` is the end marker of a thinking block the prompt left open
    (templates such as Qwen 3's and DeepSeek-R1's end the generation prompt with
    ``<think>\\n``): the grammar writes it first, so the call is the answer and not
    text inside the reasoning, which no client would run.

    Returns None for other call syntaxes, where forcing stays the template's job.
    """
    if parser is None or parser.name != "json_tools" or not tools:
        return None
    from llguidance import LLMatcher

    from gmlx.engine.structured import Grammar

    variants = []
    for tool in tools:
        params = tool.parameters or {"type": "object"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,  # the call object is ours: name and arguments only
        })
    schema: dict[str, Any] = {"anyOf": variants} if len(variants) > 1 else dict(variants[0])
    schema["x-guidance"] = _COMPACT_JSON
    from gmlx.engine.structured import lark_literal

    def marker(text: str) -> str:
        return lark_literal(tokenizer, text)

    # The empty block Qwen 3 renders with thinking off is "<think>\n\n</think>\n\n": the
    # newline before the marker is optional, so a thinking budget that forces the
    # marker at once agrees with the grammar.
    head = f'"\\n"? {marker(close_thinking)} "\\n\\n" ' if close_thinking else ""
    lark = (f'start: {head}{marker(parser.start)} "\\n" call "\\n" {marker(parser.end)}\n'
            f"call: %json {json.dumps(schema)}")
    grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        log.warning("cannot force a tool call with these tools: %s", messages[0] if messages else "")
        return None
    return Grammar(grammar, "tool_call")
