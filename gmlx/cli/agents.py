"""How each coding agent is pointed at a gmlx server: its environment, files and arguments.

Pure: nothing here asks a server, writes a file or starts a process (``gmlx launch``
does). Each setup was checked against the agent's own package: claude-code 2.1.197,
codex 0.171.0, pi-coding-agent 0.73.1 and opencode 1.18.33. An API key never lands in a
file: the files name an environment variable (``GMLX_API_KEY``) that holds it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Agents refuse to start without some key; a server run without --api-key ignores it.
NO_KEY = "gmlx"
KEY_VAR = "GMLX_API_KEY"
# An answer may take a quarter of the window, so a long conversation still has room to
# grow; beyond 8k tokens one answer is rarely useful and only delays compaction.
MAX_OUTPUT_CAP = 8192


def output_cap(window: int) -> int:
    """Most tokens per answer for a model with ``window`` tokens of context."""
    return max(1, min(window // 4, MAX_OUTPUT_CAP))


@dataclass(frozen=True)
class Served:
    """The model an agent is pointed at, as the server serves it."""

    url: str  # the server's base URL, without a trailing slash
    model: str  # what the agent asks for: an id, an alias or ``id@profile``
    window: int  # context window in tokens
    cap: int  # most output tokens per answer
    api_key: str | None = None


@dataclass(frozen=True)
class Setup:
    """What starting an agent takes: variables to set and to remove, files to write, and
    arguments that go before the user's own."""

    env: dict[str, str]
    files: dict[Path, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    unset: tuple[str, ...] = ()


@dataclass(frozen=True)
class Agent:
    name: str
    binary: str
    package: str  # the npm package that installs ``binary``
    configure: Callable[[Served, Path], Setup]  # (the model, a folder gmlx owns for it)


def _key_env(served: Served) -> dict[str, str]:
    return {KEY_VAR: served.api_key} if served.api_key else {}


def claude(served: Served, folder: Path) -> Setup:
    """Claude Code talks Anthropic Messages to ``ANTHROPIC_BASE_URL``; every model tier
    it picks from (main, small/fast, haiku, sonnet, opus) is the served model."""
    env = {
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_AUTH_TOKEN": served.api_key or NO_KEY,
        "ANTHROPIC_MODEL": served.model,
        "ANTHROPIC_SMALL_FAST_MODEL": served.model,  # deprecated, still read by 2.1
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": served.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": served.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": served.model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(served.cap),
        # The window: for a model whose id does not start with `claude-`, 2.1 takes
        # CLAUDE_CODE_MAX_CONTEXT_TOKENS as the model's window and compacts before it.
        # CLAUDE_CODE_AUTO_COMPACT_WINDOW cannot say it: it is raised to at least
        # 100,000 tokens and only ever lowers the model's own window.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.window),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    # A key for Anthropic's API in the user's environment would be sent along (and
    # makes Claude Code ask which key to use): the local server is not Anthropic.
    return Setup(env=env, unset=("ANTHROPIC_API_KEY",))


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string (ASCII, \u escapes) is a TOML basic string


def codex(served: Served, folder: Path) -> Setup:
    """Codex reads ``$CODEX_HOME/config.toml``; a folder of gmlx's own leaves
    ``~/.codex`` (the user's config, login and history) alone."""
    lines = [
        "# Written by `gmlx launch codex` on each launch.",
        'model_provider = "gmlx"',
        f"model = {_toml(served.model)}",
        f"model_context_window = {served.window}",
        # Codex 0.171 has no output cap setting (`model_max_output_tokens` is gone), so
        # the server bounds each answer by the window.
        "",
        "[model_providers.gmlx]",
        'name = "gmlx"',
        f"base_url = {_toml(served.url + '/v1')}",
        'wire_api = "responses"',  # the only wire API 0.171 still speaks
    ]
    if served.api_key:
        lines.append(f'env_key = "{KEY_VAR}"')
    return Setup(
        env={"CODEX_HOME": str(folder), **_key_env(served)},
        files={folder / "config.toml": "\n".join(lines) + "\n"},
    )


def pi(served: Served, folder: Path) -> Setup:
    """pi reads ``models.json`` in its agent folder, ``$PI_CODING_AGENT_DIR`` (default
    ``~/.pi/agent``); ``--provider`` and ``--model`` pick the served model."""
    model = {
        "id": served.model,
        "name": served.model,
        "contextWindow": served.window,
        "maxTokens": served.cap,
        "reasoning": False,
        "input": ["text"],
    }
    provider = {
        "baseUrl": served.url + "/v1",
        "api": "openai-completions",
        # pi reads an apiKey that names a set environment variable as that variable.
        "apiKey": KEY_VAR if served.api_key else NO_KEY,
        "models": [model],
    }
    text = json.dumps({"providers": {"gmlx": provider}}, indent=2) + "\n"
    return Setup(
        env={"PI_CODING_AGENT_DIR": str(folder), **_key_env(served)},
        files={folder / "models.json": text},
        args=["--provider", "gmlx", "--model", served.model],
    )


def opencode(served: Served, folder: Path) -> Setup:
    """opencode merges the file ``$OPENCODE_CONFIG`` names over the user's own config,
    so their settings stay and the gmlx provider and model are added."""
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "gmlx",
        "options": {
            "baseURL": served.url + "/v1",
            "apiKey": f"{{env:{KEY_VAR}}}" if served.api_key else NO_KEY,
        },
        "models": {
            served.model: {
                "name": served.model,
                "limit": {"context": served.window, "output": served.cap},
            }
        },
    }
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"gmlx": provider},
        "model": f"gmlx/{served.model}",
    }
    path = folder / "opencode.json"
    return Setup(
        env={"OPENCODE_CONFIG": str(path), "OPENCODE_DISABLE_AUTOUPDATE": "1", **_key_env(served)},
        files={path: json.dumps(config, indent=2) + "\n"},
    )


AGENTS: dict[str, Agent] = {
    a.name: a
    for a in (
        Agent("claude", "claude", "@anthropic-ai/claude-code", claude),
        Agent("codex", "codex", "@openai/codex", codex),
        Agent("pi", "pi", "@mariozechner/pi-coding-agent", pi),
        Agent("opencode", "opencode", "opencode-ai", opencode),
    )
}
