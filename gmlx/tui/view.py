"""The ``/v1/metrics`` snapshot as `gmlx top` shows it: typed rows and their cells.

Pure functions of a :class:`~gmlx.tui.source.Poll`, with no Textual in them, so the
dashboard's widgets and ``gmlx top --once`` (a Rich table) show the same words.
A field the server leaves null (a probe that failed) shows as ``—``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gmlx.engine.capacity import human

DASH = "—"

# Rich styles for the governor's bands; the band's name is always written beside
# its colour, so the header reads the same without colours (NO_COLOR).
BAND_STYLES = {
    "green": "bold green",
    "yellow": "bold yellow",
    "orange": "bold dark_orange",
    "red": "bold red",
}


def size(n: float | None) -> str:
    return DASH if n is None else human(n)


def seconds(s: float | None, digits: int = 1) -> str:
    return DASH if s is None else f"{s:.{digits}f}s"


def duration(s: float | None) -> str:
    """``42 s``, ``3m 05s``, ``2h 07m``: uptime and elapsed times."""
    if s is None:
        return DASH
    s = int(s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def rate(v: float | None) -> str:
    return DASH if v is None else f"{v:.1f}"


def count(v: int | None) -> str:
    return DASH if v is None else str(v)


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    cell: Callable[[dict[str, Any]], str]
    sort: Callable[[dict[str, Any]], Any]
    right: bool = True


def _short_id(rid: str) -> str:
    # Six hex digits tell a screenful of requests apart and keep 80 columns enough.
    return rid.removeprefix("req-")[:6]


def _state(r: dict[str, Any]) -> str:
    # A queued request's place in its queue rides with its state, saving a column.
    state = str(r.get("state", DASH))
    return f"{state} #{r['position']}" if r.get("position") else state


def _generated(r: dict[str, Any]) -> str:
    return f"{r.get('generated') or 0}/{count(r.get('max_tokens'))}"


def _cache(r: dict[str, Any]) -> str:
    cache = r.get("cache") or {}
    if not cache.get("tier"):
        return DASH
    return f"{cache['tier']} {cache.get('warm_tokens') or 0}"


def _num(key: str) -> Callable[[dict[str, Any]], float]:
    # Nulls sort below every number, whichever way the column is sorted.
    return lambda r: -1.0 if r.get(key) is None else float(r[key])


STATE_ORDER = {"queued": 0, "prefill": 1, "decode": 2}

REQUEST_COLUMNS: tuple[Column, ...] = (
    Column(
        "id",
        "id",
        lambda r: _short_id(str(r.get("id", ""))),
        lambda r: str(r.get("id", "")),
        right=False,
    ),
    Column(
        "model",
        "model",
        lambda r: str(r.get("model", DASH)),
        lambda r: str(r.get("model", "")),
        right=False,
    ),
    Column(
        "state",
        "state",
        _state,
        lambda r: (STATE_ORDER.get(r.get("state", ""), 3), r.get("position") or 0),
        right=False,
    ),
    Column(
        "prompt_tokens", "prompt", lambda r: count(r.get("prompt_tokens")), _num("prompt_tokens")
    ),
    Column("generated", "gen/max", _generated, _num("generated")),
    Column("ttft_s", "ttft", lambda r: seconds(r.get("ttft_s"), 2), _num("ttft_s")),
    Column("decode_tok_s", "tok/s", lambda r: rate(r.get("decode_tok_s")), _num("decode_tok_s")),
    Column(
        "cache",
        "cache",
        _cache,
        lambda r: (r.get("cache") or {}).get("warm_tokens") or 0,
        right=False,
    ),
    Column("elapsed_s", "elapsed", lambda r: duration(r.get("elapsed_s")), _num("elapsed_s")),
)
COLUMN_KEYS = tuple(c.key for c in REQUEST_COLUMNS)


def request_rows(
    rows: list[dict[str, Any]],
    *,
    sort_key: str | None = None,
    reverse: bool = False,
    model_filter: str = "",
) -> list[dict[str, Any]]:
    """The rows the requests table shows: those whose model contains ``model_filter``
    (case-insensitive), in the server's order (queued first) or sorted by a column."""
    needle = model_filter.strip().lower()
    shown = [r for r in rows if needle in str(r.get("model", "")).lower()]
    column = next((c for c in REQUEST_COLUMNS if c.key == sort_key), None)
    if column is not None:
        shown.sort(key=column.sort, reverse=reverse)
    return shown


def request_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(c.cell(row) for c in REQUEST_COLUMNS)


# -- models -----------------------------------------------------------------------------

MODEL_HEADERS = ("model", "marks", "running", "waiting", "weights", "prompt cache", "context")


def model_rows(
    server: dict[str, Any], listing: tuple[dict[str, Any], ...] = ()
) -> list[dict[str, Any]]:
    """The resident models, each with what ``/v1/models`` adds (default, context)."""
    by_id = {m.get("id"): m for m in listing}
    return [{**by_id.get(m.get("id"), {}), **m} for m in server.get("resident_models") or []]


def model_cells(m: dict[str, Any]) -> tuple[str, ...]:
    marks = [name for name in ("pinned", "kept", "default") if m.get(name)]
    cache = size(m.get("prompt_cache_bytes"))
    if m.get("prompt_cache_hit_rate") is not None:  # newer servers may add it
        cache += f" ({m['prompt_cache_hit_rate']:.0%} hit)"
    context = m.get("max_context_at_width_1") or m.get("context_length")
    return (
        str(m.get("id", DASH)),
        " ".join(marks) or DASH,
        f"{count(m.get('in_flight'))}/{count(m.get('decode_batch'))}",
        count(m.get("waiting")),
        size(m.get("weight_bytes")),
        cache,
        count(context),
    )


# -- header -----------------------------------------------------------------------------


def queue_line(server: dict[str, Any]) -> str:
    q = server.get("queue") or {}
    c = server.get("concurrency") or {}
    eta = q.get("eta_s")
    parts = [
        f"running {count(c.get('in_flight'))}/{count(c.get('decode_batch'))}",
        f"queue {count(q.get('waiting'))}/{count(q.get('cap'))}",
    ]
    if eta:
        parts.append(f"eta {eta:.1f} s")
    return "  ".join(parts)


def memory_parts(server: dict[str, Any]) -> dict[str, int | None]:
    """active, cache, headroom, floor and total bytes (null where a probe failed)."""
    mem = server.get("memory") or {}
    gov = server.get("governor") or {}
    return {
        "active": mem.get("active_bytes"),
        "cache": mem.get("cache_bytes"),
        "headroom": mem.get("headroom_bytes")
        if mem.get("headroom_bytes") is not None
        else gov.get("headroom_bytes"),
        "floor": gov.get("floor_bytes"),
        "total": mem.get("total_bytes"),
    }


BAR_GLYPHS = {"active": "█", "cache": "▓", "other": "▒", "headroom": "░"}


def memory_bar(server: dict[str, Any], width: int) -> list[tuple[str, str]]:
    """The memory bar as (glyphs, part) runs, ``width`` cells for all of memory:
    MLX active, MLX cache, the rest in use (other processes), then headroom; the
    floor is a ``|`` inside the headroom, where the governor starts to shed."""
    p = memory_parts(server)
    total = p["total"]
    if not total or width < 4:
        return [("?" * max(width, 0), "other")]

    def cells(n: int | None) -> int:
        return round(width * (n or 0) / total)

    active, cache = cells(p["active"]), cells(p["cache"])
    headroom = min(cells(p["headroom"]), width - active - cache)
    other = max(width - active - cache - headroom, 0)
    runs = [("active", active), ("cache", cache), ("other", other), ("headroom", headroom)]
    out = [(BAR_GLYPHS[name] * n, name) for name, n in runs if n > 0]
    floor = cells(p["floor"])
    if p["floor"] and 0 < floor <= headroom:
        # The floor sits ``floor`` cells from the right end: headroom below it sheds.
        glyphs, _ = out.pop()
        cut = len(glyphs) - floor
        out += [(glyphs[:cut], "headroom"), ("|", "floor"), (glyphs[cut + 1 :], "headroom")]
    return [(g, name) for g, name in out if g]


def memory_legend(server: dict[str, Any]) -> str:
    p = memory_parts(server)
    return (
        f"{BAR_GLYPHS['active']} active {size(p['active'])}  {BAR_GLYPHS['cache']} cache {size(p['cache'])}  "
        f"{BAR_GLYPHS['headroom']} headroom {size(p['headroom'])}  | floor {size(p['floor'])}"
    )


def band(server: dict[str, Any]) -> str | None:
    gov = server.get("governor") or {}
    return gov.get("band") if gov.get("enabled") is not False else None
