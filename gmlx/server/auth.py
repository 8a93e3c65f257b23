"""The API key check every route but ``/health`` depends on."""

from __future__ import annotations

import secrets

from fastapi import Request

from gmlx.engine.errors import AuthenticationError


async def require_api_key(request: Request) -> None:
    """Pass when no key is set, or when the request carries it as ``Authorization:
    Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic clients).

    Raises AuthenticationError (401) otherwise.
    """
    key: str | None = request.app.state.settings.server.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, bearer = auth.partition(" ")
    offered = [
        bearer.strip() if scheme.lower() == "bearer" else "",
        request.headers.get("x-api-key", ""),
    ]
    if not any(o and secrets.compare_digest(o.encode(), key.encode()) for o in offered):
        raise AuthenticationError(
            "Missing or wrong API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`."
        )
