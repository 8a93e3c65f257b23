"""Speculative decoding's settings and counters: what a model's config asks for and
what a request's metrics row reports. Light to import (no MLX): the config, the
model listing and the CLI read it; the drafting itself is ``gmlx.engine.speculative``
(the batched verification) and ``gmlx.engine.drafters`` (who proposes the drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gmlx.engine.errors import InvalidRequestError

DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class DraftSpec:
    """How one model drafts: a draft model (its source, resolved from a configured id
    or a path), or prompt lookup (n-gram matches in the request's own tokens), and how
    many tokens each round drafts."""

    draft_source: str | None = None
    prompt_lookup: bool = False
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    def __post_init__(self) -> None:
        if (self.draft_source is None) == (not self.prompt_lookup):
            raise ValueError("a draft spec names a draft model or prompt lookup, and only one")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}")

    @property
    def drafter(self) -> str:
        """What drafts, in words: ``prompt-lookup`` or the draft model's source."""
        return "prompt-lookup" if self.prompt_lookup else str(self.draft_source)


@dataclass
class SpecStats:
    """One request's drafting so far: verification rounds it took part in, tokens
    drafted for it and accepted. Counted per stream, so exact at any width."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def note(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted

    def row(self) -> dict[str, Any]:
        """The metrics row's ``speculative`` object."""
        rate = round(self.accepted / self.drafted, 3) if self.drafted else None
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "accept_rate": rate}


def refuse_structured(model_id: str, grammar: Any) -> None:
    """Raise the spec's error for a structured-output request (a response format's
    grammar) to a speculative model: its drafts are verified without request-level
    logits processors. A forced tool call's grammar runs (undrafted, see
    ``gmlx.engine.speculative``)."""
    if grammar is not None and getattr(grammar, "kind", None) in ("json_object", "json_schema"):
        raise InvalidRequestError(
            f"Model {model_id} decodes speculatively, which cannot apply a response format's "
            "grammar; send this request to a model without a drafter.",
            param="response_format",
        )
