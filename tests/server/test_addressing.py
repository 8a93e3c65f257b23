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
        reg.address("a", profile="nope")


def test_a_suffix_that_is_no_profile_is_part_of_the_id():
    reg = registry(ModelSpec("a", "demo"), ModelSpec("b@nope", "demo"))
    with pytest.raises(ModelNotFoundError) as err:
        reg.address("a@nope")
    assert "'a@nope'" in str(err.value) and err.value.status == 404
    assert reg.address("b@nope").spec.id == "b@nope"  # not "b" with profile "nope"
    assert reg.address("b@nope@mine").profile_name == "mine"


def test_an_alias_to_an_unknown_profile_is_refused():
    with pytest.raises(ValueError, match="not a served model"):
        registry(ModelSpec("m", "demo"), aliases={"x": "m@nope"})


# -- through a real server and the OpenAI SDK ------------------------------------------

HI = [{"role": "user", "content": "Hi"}]


def test_a_suffix_that_is_no_profile_is_a_404_naming_the_whole_id(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as nf:
        openai_client.chat.completions.create(
            model="demo@not-a-profile", messages=HI, max_tokens=2
        )
    body = nf.value.body
    assert body["type"] == "model_not_found" and body["code"] == "model_not_found"
    assert "'demo@not-a-profile'" in body["message"]
    assert body["available_models"] == ["demo", "tiny"]


def test_the_profile_field_still_names_an_unknown_profile(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(
            model="demo", messages=HI, max_tokens=2, extra_body={"profile": "not-a-profile"}
        )
    body = bad.value.body
    assert body["type"] == "unknown_profile" and "coding" in body["valid_profiles"]
    assert "'not-a-profile'" in body["message"]


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
    # vlm: only once a vision part really loaded (a configured mmproj is not enough)
    assert (m.id, m.resident, m.pinned, m.vlm, m.context_length) == ("m", False, True, False, 512)
    assert (c.id, c.alias_of, c.profile, c.default) == ("c", "m", "mine", False)
