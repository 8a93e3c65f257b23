"""The command-line reference, ``docs/cli.md``, generated from the Typer app.

It walks the Click command tree of :data:`gmlx.cli.main.app` (never ``--help`` output),
so it knows every command and subcommand, its arguments and options with their types,
defaults and help, and the exit codes its epilog states. The text depends on nothing but
the app: no terminal width, no colours. ``python -m gmlx.cli.reference`` rewrites the
shipped copy, and a test fails while that copy is stale.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.text import Text

if TYPE_CHECKING:
    # Typer >= 0.20 carries its own copy of Click; the command tree is made of these.
    from typer._click.core import Command, Parameter

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
REGENERATE = "python -m gmlx.cli.reference"

# The epilog convention: "Exit codes: 0 done; 1 failed ...; 2 usage error." Items are
# split on "; " before a number, so an item's own words may hold commas; an epilog with
# no ";" may separate them with ", " instead ("0 done, 1 failed, 2 usage error").
EXIT_CODES_PREFIX = "Exit codes:"
_EXIT_ITEM_SPLIT = re.compile(r";\s+(?=\d+\s)")
_EXIT_ITEM_SPLIT_COMMAS = re.compile(r",\s+(?=\d+\s)")
_EXIT_ITEM = re.compile(r"(\d+)\s+(.*)", re.DOTALL)

PREFACE = (
    "Every command takes `--help`. A failure is one sentence on stderr and exit code 1 "
    "(`GMLX_DEBUG=1` adds the traceback); a usage error is exit code 2. Commands that "
    "report take `--json`, and output carries no colour when it is not a terminal or "
    "`NO_COLOR` is set."
)


def plain(text: str | None) -> str:
    """Help text as ``--help`` shows it: the docstring's indentation removed, each
    paragraph on one line, Rich markup rendered to its plain words."""
    if not text:
        return ""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    # The app uses rich markup mode, so `--help` renders markup; the reference says the same.
    return "\n\n".join(Text.from_markup(" ".join(p.split())).plain for p in paragraphs if p.strip())


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def code(text: str) -> str:
    return f"`{text}`" if text else ""


# -- parameters ---------------------------------------------------------------------------


def is_argument(param: Parameter) -> bool:
    return param.param_type_name == "argument"


def is_flag(param: Parameter) -> bool:
    return bool(getattr(param, "is_flag", False) or getattr(param, "count", False))


def param_type(param: Parameter, ctx: typer.Context) -> str:
    """``flag`` for a boolean flag, else the type ``--help`` shows (``int``, ``path``, ...)."""
    if is_flag(param):
        return "flag"
    shown = param.display_type(ctx).strip("<>")  # type: ignore[attr-defined]  # Typer's own
    # "int range": the range itself goes in the cell, after the type.
    return shown.removesuffix(" range")


def param_range(param: Parameter) -> str:
    """The values a number accepts, ``≥ 1`` or ``0 to 65535``; empty when any."""
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is not None and high is not None:
        return f"{low} to {high}"
    if low is not None:
        return f"≥ {low}"
    if high is not None:
        return f"≤ {high}"
    return ""


def param_default(param: Parameter, ctx: typer.Context) -> str:
    """The default as the reader needs it: ``required``, the value, or ``—`` where there is
    none or the help text states it (``show_default=False``)."""
    if param.required:
        return "required"
    show = getattr(param, "show_default", None)
    if isinstance(show, str):
        return show
    if show is False:
        return "—"
    value = param.get_default(ctx, call=False)
    if callable(value):
        return "(dynamic)"
    if is_flag(param):
        if param.secondary_opts:  # --think/--no-think: the side that applies, if any
            if value is None:
                return "—"
            return code((param.opts if value else param.secondary_opts)[0])
        return "on" if value else "off"
    if value is None or value == () or value == []:
        return "—"
    if isinstance(value, (list, tuple)):
        return ", ".join(code(str(v)) for v in value)
    return code(str(getattr(value, "value", value)))


def param_env(param: Parameter) -> str:
    """The sentence naming the environment variables the value can come from."""
    envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
    return ("Env: " + ", ".join(code(e) for e in envvars) + ".") if envvars else ""


def argument_name(param: Parameter) -> str:
    return (param.metavar or param.name or "").upper()


def param_name(param: Parameter) -> str:
    if is_argument(param):
        return code(argument_name(param) + ("..." if param.nargs != 1 else ""))
    return ", ".join(code(n) for n in [*param.opts, *param.secondary_opts])


def usage(command: Command, ctx: typer.Context) -> str:
    """``gmlx x [OPTIONS] MODEL [MORE]...``: optional arguments in brackets."""
    pieces = [ctx.command_path, "[OPTIONS]"]
    for p in command.get_params(ctx):
        if is_argument(p) and not getattr(p, "hidden", False):
            name = argument_name(p) if p.required else f"[{argument_name(p)}]"
            pieces.append(name + ("..." if p.nargs != 1 else ""))
    metavar = getattr(command, "subcommand_metavar", None)
    if metavar and getattr(command, "commands", None):
        pieces.append(metavar)
    return " ".join(pieces)


def param_rows(params: list[Parameter], ctx: typer.Context) -> list[str]:
    lines = ["| Name | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for p in params:
        help_text = " ".join(t for t in (plain(getattr(p, "help", None)), param_env(p)) if t)
        kind = " ".join(t for t in (code(param_type(p, ctx)), param_range(p)) if t)
        row = [param_name(p), kind, param_default(p, ctx), help_text]
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    return lines


# -- commands -----------------------------------------------------------------------------


def exit_codes(epilog: str | None) -> list[tuple[str, str]] | None:
    """The ``Exit codes: ...`` the epilog states, as (code, meaning) pairs; None when it
    states none."""
    text = plain(epilog)
    if EXIT_CODES_PREFIX not in text:
        return None
    stated = text.split(EXIT_CODES_PREFIX, 1)[1].strip().rstrip(".")
    items = (_EXIT_ITEM_SPLIT if ";" in stated else _EXIT_ITEM_SPLIT_COMMAS).split(stated)
    pairs = []
    for item in items:
        match = _EXIT_ITEM.fullmatch(item.strip())
        if match is None:  # not in the convention: keep the sentence whole
            return [("", text.split(EXIT_CODES_PREFIX, 1)[1].strip())]
        pairs.append((match[1], match[2].strip()))
    return pairs


def walk(command: Command, ctx: typer.Context) -> Iterator[tuple[Command, typer.Context]]:
    """The command and, depth first in the order ``--help`` lists them, every visible
    subcommand, each with its context (so its path reads ``gmlx serve``, ``gmlx x y``)."""
    yield command, ctx
    subcommands: dict[str, Command] = getattr(command, "commands", None) or {}
    lister = getattr(command, "list_commands", None)
    names = lister(ctx) if lister is not None else list(subcommands)
    for name in names:
        sub = subcommands.get(name)
        if sub is None or sub.hidden:
            continue
        yield from walk(sub, typer.Context(sub, info_name=name, parent=ctx))


def short_help(command: Command) -> str:
    return plain(command.short_help) or plain(command.help).split("\n\n")[0]


def anchor(path: str) -> str:
    """The anchor GitHub gives a ``## `gmlx x` `` heading."""
    return re.sub(r"[^a-z0-9 -]", "", path.lower()).replace(" ", "-")


def command_section(command: Command, ctx: typer.Context) -> list[str]:
    path = ctx.command_path
    lines = [f"## `{path}`", ""]
    if command.deprecated:
        lines += ["*Deprecated.*", ""]
    lines += ["```text", usage(command, ctx), "```", ""]
    help_text = plain(command.help)
    if help_text:
        lines += [help_text, ""]
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    # --help is on every command; the preface says so once.
    params = [p for p in params if p.name != "help"]
    arguments = [p for p in params if is_argument(p)]
    options = [p for p in params if not is_argument(p)]
    if arguments:
        lines += ["### Arguments", "", *param_rows(arguments, ctx), ""]
    if options:
        lines += ["### Options", "", *param_rows(options, ctx), ""]
    subcommands = [(s, c) for s, c in walk(command, ctx) if c.parent is ctx]
    if subcommands:
        lines += ["### Commands", ""]
        lines += [
            f"- [`{c.command_path}`](#{anchor(c.command_path)}): {short_help(s)}"
            for s, c in subcommands
        ]
        lines.append("")
    codes = exit_codes(command.epilog)
    if codes is not None:
        lines += ["### Exit codes", ""]
        lines += [f"- `{n}`: {meaning}" if n else f"- {meaning}" for n, meaning in codes]
        lines.append("")
    epilog = plain(command.epilog)
    prose = epilog.split(EXIT_CODES_PREFIX, 1)[0].strip() if codes is not None else epilog
    if prose:
        lines += [prose, ""]
    return lines


def render(app: typer.Typer | None = None) -> str:
    """The Markdown reference of ``app`` (default: the ``gmlx`` app) under its name,
    ending in one newline."""
    if app is None:
        from gmlx.cli.main import app
    prog = app.info.name or "gmlx"
    root = typer.main.get_command(app)
    root_ctx = typer.Context(root, info_name=prog)
    lines = [
        f"# `{prog}` command-line reference",
        "",
        f"<!-- Generated from the Typer app by `{REGENERATE}`; do not edit by hand. -->",
        "",
        PREFACE,
        "",
    ]
    entries = list(walk(root, root_ctx))
    lines += ["| Command | What it does |", "| --- | --- |"]
    for command, ctx in entries[1:]:
        link = f"[`{ctx.command_path}`](#{anchor(ctx.command_path)})"
        lines.append(f"| {link} | {cell(short_help(command))} |")
    lines.append("")
    for command, ctx in entries:
        lines += command_section(command, ctx)
    return "\n".join(lines).rstrip("\n") + "\n"


def write(path: Path = REFERENCE_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return path


if __name__ == "__main__":
    print(write())
