"""What a config reload did to the served models, by id.

:meth:`Registry.reconfigure <gmlx.engine.residency.Registry.reconfigure>` swaps in the
new model book; :func:`reload_result` compares the specs before and after, so a
config reload (``gmlx.compose.reload_config``) can say which models were added,
removed, changed (they load anew) or left as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gmlx.engine.addressing import ModelSpec


@dataclass(frozen=True)
class ReloadResult:
    """Model ids by what a reconfiguration did to them: ``changed`` ones changed their
    load parameters (they load anew), ``unchanged`` ones kept them (and their worker)."""

    added: list[str]
    removed: list[str]
    changed: list[str]
    unchanged: list[str]


def reload_result(old: Mapping[str, ModelSpec], new: Mapping[str, ModelSpec]) -> ReloadResult:
    """The served models sorted by what going from ``old`` to ``new`` does to them (in
    ``new``'s order, removed ones in ``old``'s): a model is changed when its load
    parameters (``ModelSpec.load_parameters``) differ."""
    changed = [i for i in new if i in old and new[i].load_parameters != old[i].load_parameters]
    return ReloadResult(
        added=[i for i in new if i not in old],
        removed=[i for i in old if i not in new],
        changed=changed,
        unchanged=[i for i in new if i in old and i not in changed],
    )
