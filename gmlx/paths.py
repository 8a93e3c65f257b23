"""Where gmlx keeps its files. Every location honours an environment override."""

from __future__ import annotations

import os
from pathlib import Path


def home_override() -> Path | None:
    home = os.environ.get("GMLX_HOME")
    return Path(home).expanduser() if home else None


def cache_dir() -> Path:
    """``$GMLX_CACHE_DIR``, else ``$GMLX_HOME/cache``, else the user cache dir
    (``$XDG_CACHE_HOME/gmlx`` on Linux, ``~/Library/Caches/gmlx`` on macOS)."""
    if env := os.environ.get("GMLX_CACHE_DIR"):
        return Path(env).expanduser()
    if home := home_override():
        return home / "cache"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("gmlx", appauthor=False))


def config_file() -> Path:
    """The default config file: ``$GMLX_HOME/gmlx.yaml`` or ``~/.config/gmlx/gmlx.yaml``."""
    if home := home_override():
        return home / "gmlx.yaml"
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "gmlx" / "gmlx.yaml"


def launch_dir() -> Path:
    """Where ``gmlx launch`` keeps what it owns: the server it starts (``server-PORT.log``,
    ``server-PORT.pid``) and each agent's config folder (``codex/``, ``pi/``, ``opencode/``)."""
    return cache_dir() / "launch"
