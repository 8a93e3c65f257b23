"""Where `gmlx top` gets its numbers: the :class:`MetricsSource` protocol and its HTTP
implementation.

A source answers :meth:`MetricsSource.poll` with a :class:`Poll`, never an exception:
a server that is down, refuses the key or is not a gmlx server comes back as a
:class:`SourceError` with one sentence, so the dashboard keeps polling and shows it.
The actions (cancel, unload, keep) answer an :class:`ActionResult` the same way.
The poll carries its own wall-clock time, so a scripted source can fix it and the
dashboard's "disconnected since HH:MM:SS" stays stable under test.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from gmlx.replies import keep_line, refusal, unload_line, unreachable

if TYPE_CHECKING:
    import httpx


class Trouble(enum.Enum):
    """Why a poll got no snapshot; the dashboard says each differently."""

    UNREACHABLE = "unreachable"  # nothing answers: down, restarting, a wrong port
    UNAUTHORIZED = "unauthorized"  # 401: the key is missing or wrong
    NOT_GMLX = "not_gmlx"  # something answered, but not with a gmlx snapshot
    REFUSED = "refused"  # any other error answer


@dataclass(frozen=True)
class SourceError:
    trouble: Trouble
    sentence: str


@dataclass(frozen=True)
class Poll:
    """One poll: the ``/v1/metrics`` document and the ``/v1/models`` rows, or why not.

    ``metrics`` is the whole document (``{"server": {...}}``); ``models`` is
    ``/v1/models``'s ``data`` (empty when that route failed but metrics did not).
    """

    at: datetime
    metrics: dict[str, Any] | None = None
    models: tuple[dict[str, Any], ...] = ()
    error: SourceError | None = None

    @property
    def server(self) -> dict[str, Any]:
        """The ``server`` object of the snapshot (empty without one)."""
        return (self.metrics or {}).get("server") or {}


@dataclass(frozen=True)
class ActionResult:
    ok: bool
    sentence: str


class MetricsSource(Protocol):
    """What the dashboard reads and acts on; HTTP in life, scripted in tests."""

    url: str

    async def poll(self) -> Poll: ...

    async def cancel(self, request_id: str) -> ActionResult: ...

    async def unload(self, model: str) -> ActionResult: ...

    async def keep(self, model: str, keep: bool) -> ActionResult: ...

    async def close(self) -> None: ...


UNAUTHORIZED = "The server refused the key (401): pass its key with --api-key or GMLX_API_KEY."


class HttpSource:
    """A :class:`MetricsSource` over a running gmlx server at ``url``, with one async
    httpx client (made on first use, in the loop that polls)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.url, headers=headers, timeout=httpx.Timeout(self.timeout)
            )
        return self._client

    async def _call(
        self,
        method: str,
        path: str,
        json: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> tuple[Any, SourceError | None]:
        """The JSON answer of one request, or the error that says why there is none."""
        import httpx

        try:
            kwargs: dict[str, Any] = {"json": json} if json is not None else {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            r = await self._http().request(method, path, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as e:  # refused, reset, DNS, timeouts
            return None, SourceError(Trouble.UNREACHABLE, unreachable(self.url, e))
        if r.status_code == 401:
            return None, SourceError(Trouble.UNAUTHORIZED, UNAUTHORIZED)
        try:
            body = r.json()
        except ValueError:
            return None, SourceError(
                Trouble.NOT_GMLX,
                f"{self.url} answered {method} {path} with {r.status_code} and no JSON: "
                "is it a gmlx server?",
            )
        if r.status_code >= 400:
            trouble = Trouble.NOT_GMLX if r.status_code == 404 else Trouble.REFUSED
            return None, SourceError(trouble, refusal(r.status_code, body, self.url))
        return body, None

    async def poll(self) -> Poll:
        now = datetime.now()
        metrics, error = await self._call("GET", "/v1/metrics")
        if error is not None:
            return Poll(at=now, error=error)
        if not isinstance(metrics, dict) or not isinstance(metrics.get("server"), dict):
            return Poll(
                at=now,
                error=SourceError(
                    Trouble.NOT_GMLX,
                    f"{self.url}/v1/metrics answered without a `server` snapshot: "
                    "is it a gmlx server?",
                ),
            )
        models, _ = await self._call("GET", "/v1/models")  # markers only: optional
        data = models.get("data") if isinstance(models, dict) else None
        return Poll(at=now, metrics=metrics, models=tuple(data or ()))

    async def _act(
        self, path: str, json: dict[str, Any] | None, timeout: float | None = None
    ) -> tuple[dict[str, Any], ActionResult | None]:
        """The answer of one action, or the failed result that says why there is none."""
        body, error = await self._call("POST", path, json, timeout)
        if error is not None:
            return {}, ActionResult(False, error.sentence)
        return (body if isinstance(body, dict) else {}), None

    async def cancel(self, request_id: str) -> ActionResult:
        _, failed = await self._act(f"/v1/requests/{request_id}/cancel", None)
        return failed or ActionResult(True, f"cancelled {request_id}")

    async def unload(self, model: str) -> ActionResult:
        body, failed = await self._act("/unload", {"model": model})
        return failed or ActionResult(True, unload_line(body, model))

    async def keep(self, model: str, keep: bool) -> ActionResult:
        # Keeping warms the model, which takes a while on a large one.
        body, failed = await self._act("/v1/keep", {"model": model, "keep": keep}, timeout=300.0)
        return failed or ActionResult(True, keep_line(body))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
