"""Addressing a model: ids, aliases, ``id@profile``, the profile field, the default."""

from __future__ import annotations

import pytest

from gmlx.engine.errors import InvalidRequestError, ModelNotFoundError, UnknownProfileError
from gmlx.engine.profiles import Profile, ProfileBook
from gmlx.engine.residency import ModelSpec, Registry

BOOK = ProfileBook({"mine": Profile("mine")})


def registry(*specs: ModelSpec, aliases: dict[str, str] | None = None) -> Registry:
    return Registry(specs, aliases=aliases, profiles=BOOK)


def test_id_profile_and_alias():
    reg = registry(ModelSpec("m", "demo", profile="chat"), aliases={"c": "m@mine"})
    assert reg.address("m").profile_name == "chat"  # the model's configured profile
    assert reg.address("m@coding").profile_name == "coding"
    assert reg.address("m@mine").profile_name == "mine"
    assert reg.address("c").spec.id == "m" and reg.address("c").profile_name == "mine"
    assert reg.address("c@coding").profile_name == "coding"
    assert reg.address("m@coding", profile="mine").profile_name == "mine"  # the field wins


def test_an_id_with_an_at_stays_intact():
    reg = registry(ModelSpec("team@v2", "demo"), ModelSpec("team", "demo"))
    assert reg.address("team@v2").spec.id == "team@v2"
    assert reg.address("team@v2@coding").spec.id == "team@v2"
    assert reg.address("team@coding").spec.id == "team"


def test_unknown_id_and_profile():
    reg = registry(ModelSpec("a", "demo"), ModelSpec("b", "demo"))
    with pytest.raises(ModelNotFoundError) as err:
        reg.address("zzz@coding")
    assert err.value.extra["available_models"] == ["a", "b"] and err.value.status == 404
    with pytest.raises(UnknownProfileError):
        reg.address("a@nope")
    with pytest.raises(UnknownProfileError):
        reg.address("a", profile="nope")


def test_empty_model():
    one = registry(ModelSpec("only", "demo"))
    assert one.address("").spec.id == "only" and one.address(None).spec.id == "only"
    two = registry(ModelSpec("a", "demo"), ModelSpec("b", "demo", default=True))
    assert two.address("").spec.id == "b"
    with pytest.raises(InvalidRequestError, match="no single default"):
        registry(ModelSpec("a", "demo"), ModelSpec("b", "demo")).address("")


def test_listing_markers():
    reg = registry(
        ModelSpec("m", "demo", max_kv_size=512, pinned=True, mmproj="p.gguf"),
        aliases={"c": "m@mine"},
    )
    m, c = reg.listing()
    assert (m.id, m.resident, m.pinned, m.vlm, m.context_length) == ("m", False, True, True, 512)
    assert (c.id, c.alias_of, c.profile, c.default) == ("c", "m", "mine", False)
