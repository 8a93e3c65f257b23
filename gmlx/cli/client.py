"""Talking to a running gmlx server: one JSON request, or one sentence when it fails.

Every command that asks a server (``estimate``, ``plan``, ``keep``, ``unload``,
``ps``) goes through :func:`call_server`, so they all say the same thing when the
server is down, slow or refuses. httpx is imported on the first call, which keeps
``gmlx --help`` fast.
"""

from __future__ import annotations

from typing import Any, NoReturn

from rich.markup import escape

from gmlx.cli.errors import fail
from gmlx.replies import refusal, unreachable

DEFAULT_URL = "http://127.0.0.1:8080"

def _fail(sentence: str) -> NoReturn:
    fail(escape(sentence))  # a server's message may hold [brackets] that are not markup


def call_server(
    method: str,
    url: str,
    path: str,
    *,
    api_key: str | None = None,
    json: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    timeout: float | None = 60.0,
) -> dict[str, Any]:
    """Send one request to the gmlx server at ``url`` and return its JSON answer.

    Args:
        method, path: the route, e.g. ``"GET", "/v1/models"``.
        api_key: sent as ``Authorization: Bearer KEY`` when set.
        json, params: the body and the query string.
        timeout: seconds to wait for the answer (None: as long as it takes, for a
            model that loads and warms); connecting gives up after 10 s either way.

    A server that cannot be reached, does not answer in time, answers without JSON
    or answers an error ends the command with one red sentence and exit code 1.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.request(
            method,
            url.rstrip("/") + path,
            headers=headers,
            json=json,
            params=params,
            timeout=httpx.Timeout(timeout, connect=10.0),
        )
    except httpx.TimeoutException as e:
        if isinstance(e, httpx.ConnectTimeout):
            _fail(unreachable(url, e))
        _fail(f"The server at {url} did not answer {method} {path} within {timeout:g} s.")
    except (httpx.HTTPError, httpx.InvalidURL) as e:  # refused, reset, DNS, a bad URL
        _fail(unreachable(url, e))
    try:
        body = r.json()
    except ValueError:
        _fail(f"The server at {url} answered {r.status_code} without JSON: is it a gmlx server?")
    if r.status_code >= 400:
        _fail(refusal(r.status_code, body, url, r.headers.get("retry-after")))
    return body
