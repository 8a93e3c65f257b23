"""Giving mlx-lm's modules another class for the engine's steps, and back.

A module keeps its parameters and its place in the model; only its ``__class__`` changes,
to a subclass whose ``__call__`` takes a faster path where it may (a subclass made once
per class, marked so it can be found and undone)."""

from __future__ import annotations

import importlib
from typing import Any


def family_classes(families: tuple[str, ...], name: str) -> frozenset[type]:
    """The class ``name`` (``Attention``, ``TransformerBlock``) of each mlx-lm model module
    in ``families`` that has it."""
    found = set()
    for family in families:
        try:
            found.add(getattr(importlib.import_module(f"mlx_lm.models.{family}"), name))
        except (ImportError, AttributeError):  # an mlx-lm without it
            continue
    return frozenset(found)


def subclass(cls: type, marker: str, call: Any) -> type:
    """``cls`` with ``call`` as its ``__call__``, marked ``marker`` for :func:`restore`."""
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": call.__module__, marker: True})


def marked(model: Any, marker: str) -> list[Any]:
    """The modules of ``model`` whose class was made with ``marker`` (by :func:`subclass`)
    and is theirs now."""
    return [module for _, module in model.named_modules() if vars(type(module)).get(marker)]


def restore(model: Any, marker: str) -> None:
    """Give every module of ``model`` whose class was made with ``marker`` its class from
    before back (a subclass made over it with another marker is left as it is)."""
    for module in marked(model, marker):
        module.__class__ = type(module).__bases__[0]
