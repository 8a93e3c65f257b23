"""What a Responses body sends, as engine values: its input items as messages and its
tools as functions.

Coding agents drive Responses statelessly (Codex sends ``store: false``): every
request carries the whole conversation, including the items gmlx returned before
(reasoning, function and custom tool calls) and the client's tool outputs. Custom
(freeform) tools, such as Codex's ``apply_patch``, take free text; a local model is
shown each as a function with one string parameter ``input``, and its calls go back
as ``custom_tool_call`` items. Hosted tools (web search, file search, ...) have no
one to run them here: they are dropped, and the route's warning names them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import Message, TextPart, ToolCall
from gmlx.server.openai import translate

INPUT_ROLES = ("user", "assistant", "system", "developer")  # of Responses message items
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")


# -- input items -------------------------------------------------------------------


def input_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> tuple[Message, ...]:
    """Responses ``instructions`` and ``input`` items as messages.

    The items of one model turn (its reasoning, its message, its calls) make one
    assistant message, as the model wrote them. Reasoning is kept on that message
    (the engine hands it to the template as ``reasoning_content``): templates that
    show reasoning again (Qwen 3's, within the turn a tool loop is in) render the
    prompt as the model wrote it, so its cached prefix is reused; the others drop it.
    Reasoning that no assistant item follows is dropped. Raises InvalidRequestError
    for an item of another type or an unknown role.
    """
    messages: list[Message] = []
    if instructions:
        messages.append(Message.text("system", instructions))
    if isinstance(items, str):
        return (*messages, Message.text("user", items))
    reasoning: list[str] = []  # reasoning items waiting for the turn they began
    for n, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item))
        elif kind == "message":
            role = item.get("role", "user")
            if role not in INPUT_ROLES:
                raise InvalidRequestError(
                    f"Unsupported input message role {role!r}; use one of "
                    f"{', '.join(INPUT_ROLES)}.",
                    param="input",
                )
            parts = translate.parts(item.get("content"), param="input", at=f"input[{n}].content")
            if role == "assistant":
                messages.append(Message("assistant", parts, reasoning=_take(reasoning)))
            else:
                reasoning.clear()
                messages.append(Message("system" if role == "developer" else role, parts))
        elif kind in CALLS:
            _add_call(messages, _call(item, kind), reasoning)
        elif kind in OUTPUTS:
            output = _output_text(item.get("output"))
            messages.append(Message.text("tool", output, tool_call_id=item.get("call_id")))
        else:
            raise InvalidRequestError(f"Unsupported input item type {kind!r}.", param="input")
    return tuple(messages)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        texts = [str(p["text"]) for p in item.get(key) or ()
                 if isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)]
        if texts:
            return "\n\n".join(texts)
    return ""


def _take(reasoning: list[str]) -> str | None:
    text = "\n\n".join(t for t in reasoning if t)
    reasoning.clear()
    return text or None


def _call(item: dict[str, Any], kind: str) -> ToolCall:
    """A function or custom tool call item as a call. A custom call's free text is
    wrapped as ``{"input": ...}``: the function the model was offered in its place
    takes that, and a template that writes arguments as JSON then writes JSON."""
    call_id, name = str(item.get("call_id") or ""), str(item.get("name") or "")
    if kind == "custom_tool_call":
        text = item.get("input")
        return ToolCall(call_id, name, json.dumps({"input": text if isinstance(text, str) else ""},
                                                  ensure_ascii=False))
    return ToolCall(call_id, name, item.get("arguments") or "{}")


def _add_call(messages: list[Message], call: ToolCall, reasoning: list[str]) -> None:
    """Join ``call`` to the assistant message it follows (the same turn), or begin one
    (after new reasoning, a turn of its own)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and not reasoning:
        messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
    else:
        messages.append(Message("assistant", tool_calls=(call,), reasoning=_take(reasoning)))


def _output_text(output: Any) -> str:
    """A tool output: a string, or content items whose text is joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(p.text for p in translate.parts(output, param="input") if isinstance(p, TextPart))
    return "" if output is None else json.dumps(output, ensure_ascii=False)


# -- tools ---------------------------------------------------------------------------


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) and custom tools, in the chat-completions
    shape; other tool types are left out (:func:`dropped_tools` names them)."""
    out = []
    for tool in tools or ():
        kind = tool.get("type", "function")
        if kind == "function":
            out.append({"type": "function", "function": {
                k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
        elif kind == "custom":
            out.append({"type": "function", "function": _custom_function(tool)})
    return out or None


def _custom_function(tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool as a function of one string, ``input``; its format (a grammar)
    is described to the model, not enforced."""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        about = (f"The tool's input: text that follows this {fmt.get('syntax') or ''} grammar:\n"
                 f"{fmt['definition']}")
    else:
        about = "The tool's input, as free text."
    function = {"name": tool.get("name"), "parameters": {
        "type": "object",
        "properties": {"input": {"type": "string", "description": about}},
        "required": ["input"],
        "additionalProperties": False,
    }}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return function


def custom_tools(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The names of the custom tools: calls to them are ``custom_tool_call`` items."""
    return frozenset(str(t.get("name")) for t in tools or () if t.get("type") == "custom")


def dropped_tools(tools: list[dict[str, Any]] | None) -> list[str]:
    """The tools no local model can call (hosted tools, namespaces): their type, and
    their name where they have one."""
    return [" ".join(str(p) for p in (t.get("type"), t.get("name")) if p)
            for t in tools or () if t.get("type", "function") not in ("function", "custom")]


def tool_choice(choice: Any) -> Any:
    """``tool_choice`` in the chat form: a named custom tool is a named function."""
    if isinstance(choice, dict) and choice.get("type") == "custom":
        return {"type": "function", "name": choice.get("name")}
    return choice


def custom_input(arguments: str) -> str:
    """The free text of a call to a custom tool: its ``input`` argument, else the
    arguments as the model wrote them."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get("input"), str):
        return args["input"]
    return arguments
