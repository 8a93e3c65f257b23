"""Every error the engine raises, typed once.

Each class carries its HTTP status and the error type names of both protocols, so
one handler renders any of them (the server) and one map turns them into a sentence
(the CLI). Subclasses may override per instance through ``extra`` fields.
"""

from __future__ import annotations

from typing import Any


class GmlxError(Exception):
    """Base of all gmlx errors; ``str(err)`` is one sentence a user can act on."""

    status: int = 500
    openai_type: str = "server_error"
    anthropic_type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.extra = extra

    def __str__(self) -> str:
        return self.message


class ConfigError(GmlxError):
    """The config file or an environment override is invalid; names the file and key."""

    code = "invalid_config"


class InvalidRequestError(GmlxError):
    """The request is malformed or asks for something unsupported."""

    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the output budget does not fit (context or memory)."""

    code = "context_length_exceeded"


class UnknownProfileError(InvalidRequestError):
    openai_type = "unknown_profile"
    code = "unknown_profile"


class AuthenticationError(GmlxError):
    status = 401
    openai_type = "authentication_error"
    anthropic_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(GmlxError):
    """A request names a model id that is not configured."""

    status = 404
    openai_type = "model_not_found"
    anthropic_type = "not_found_error"
    code = "model_not_found"


class ModelSourceError(GmlxError):
    """A model path or file cannot be loaded: missing, not a model, or unsupported."""

    status = 503
    openai_type = "model_load_error"
    anthropic_type = "api_error"
    code = "model_load_error"


class UnsupportedModelError(ModelSourceError):
    """The architecture or tensor type is not one gmlx can run."""

    code = "unsupported_model"


class ServerOverloadedError(GmlxError):
    status = 503
    openai_type = "server_overloaded"
    anthropic_type = "overloaded_error"
    code = "server_overloaded"


class RequestCancelledError(GmlxError):
    status = 499
    openai_type = "request_cancelled"
    anthropic_type = "api_error"
    code = "cancelled"


class EngineError(GmlxError):
    """Generation failed inside the engine."""

    status = 500
    openai_type = "server_error"
    anthropic_type = "api_error"
    code = "engine_error"


class ModelLoadDeferredError(GmlxError):
    """A model cannot load now beside the resident models that are pinned or busy:
    the load gate's numbers are in the message, and ``Retry-After`` says when to ask
    again."""

    status = 503
    openai_type = "model_load_deferred"
    anthropic_type = "overloaded_error"
    code = "model_load_deferred"


class ModelBusyError(GmlxError):
    """A model cannot be unloaded while it streams (requests in flight or waiting)."""

    status = 409
    openai_type = "model_busy"
    anthropic_type = "invalid_request_error"
    code = "model_busy"


class PayloadTooLargeError(GmlxError):
    """Part of a request (an image) is larger than the server's cap for it."""

    status = 413
    openai_type = "payload_too_large"
    anthropic_type = "request_too_large"
    code = "payload_too_large"


class ShuttingDownError(GmlxError):
    """The server is shutting down: a new request is refused, and a stream still
    running when the grace period ends is cut with this error (never a normal finish)."""

    status = 503
    openai_type = "server_shutting_down"
    anthropic_type = "overloaded_error"
    code = "server_shutting_down"


class SlowClientError(GmlxError):
    """A streaming client read so slowly that its stream's backlog passed the bound:
    the stream is cut and its slot freed."""

    status = 408
    openai_type = "client_too_slow"
    anthropic_type = "api_error"
    code = "client_too_slow"
