"""What a server's answers say, in words: the one sentence for a refusal or an
unreachable server, and the one line for a ``/v1/keep`` or ``/unload`` answer. Shared by
the command line (``gmlx.cli``) and the dashboard (``gmlx.tui``), so both say the same."""

from __future__ import annotations

from typing import Any

# A gmlx error body's message is one sentence a user can act on, so it is said as is.
# The CLI adds only what the server cannot know (HINTS, by the body's ``type``), and
# speaks for a server that sent no message (FALLBACKS, by HTTP status).
HINTS: dict[str, str] = {
    "authentication_error": "pass the server's key with --api-key or GMLX_API_KEY",
}
FALLBACKS: dict[int, str] = {
    409: "The model is streaming a request; retry when it finishes",
    503: "The server cannot take this now; retry {retry}",
}


def refusal(status: int, body: Any, url: str, retry_after: str | None = None) -> str:
    """The sentence for an error answer: the error body's message (else the fallback
    for its status, else the status), then the hint for its type, if any."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    retry = f"in {retry_after} s" if retry_after and retry_after.isdigit() else "later"
    fallback = FALLBACKS.get(status, f"The server at {url} answered {status}")
    message = str(err.get("message") or fallback.format(retry=retry)).rstrip(". ")
    hint = HINTS.get(str(err.get("type") or ""))
    return f"{message}: {hint}." if hint else f"{message}."


def unreachable(url: str, exc: Exception) -> str:
    """The sentence for a server that cannot be reached, with the transport's reason."""
    why = str(exc).rstrip(". ") or type(exc).__name__
    return f"Cannot reach a gmlx server at {url}: {why}."


def keep_line(body: dict[str, Any]) -> str:
    """One line for a ``/v1/keep`` answer, e.g. ``kept qwen (loaded now, warmed in 3.2 s)``."""
    model = body.get("model")
    if not body.get("kept"):
        where = (
            "still resident; its idle timeout applies again"
            if body.get("resident")
            else "not resident"
        )
        return f"released {model} ({where})"
    if body.get("loaded"):
        parts = ["loaded now"]
    elif body.get("resident"):
        parts = ["already resident"]
    else:
        parts = ["loads on its next request"]
    if body.get("warmed_s") is not None:
        parts.append(f"warmed in {body['warmed_s']:.1f} s")
    return f"kept {model} ({', '.join(parts)})"


def unload_line(body: dict[str, Any], model: str | None) -> str:
    """One line for a ``/unload`` answer: what it unloaded, or why nothing."""
    unloaded = body.get("unloaded") or []
    if unloaded:
        return "unloaded " + ", ".join(unloaded)
    if model is not None:
        return f"{model} was not resident; nothing unloaded"
    return "no idle model was resident; nothing unloaded"
