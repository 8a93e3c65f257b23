"""Profiles: family bases, built-in intents per family, user profiles, stacking."""

from __future__ import annotations

import pytest

from gmlx.engine.errors import UnknownProfileError
from gmlx.engine.profiles import BUILTIN_INTENTS, FAMILY_BASE, Profile, ProfileBook, model_family


@pytest.mark.parametrize(
    ("model_type", "family"),
    [
        ("qwen2", "qwen"),
        ("qwen3", "qwen3"),
        ("qwen3_moe", "qwen3"),
        ("llama", "llama"),
        ("gemma3_text", "gemma"),
        ("mistral3", "mistral"),
        ("phi3", "phi"),
        ("mamba", "default"),
        (None, "default"),
    ],
)
def test_model_family(model_type, family):
    assert model_family(model_type) == family


def test_no_profile_is_the_family_base():
    book = ProfileBook()
    assert book.resolve(None, "gemma3").sampling["top_k"] == 64
    assert book.resolve(None, "llama").sampling == {"temperature": 0.6, "top_p": 0.9}


def test_intents_resolve_per_family():
    book = ProfileBook()
    assert set(BUILTIN_INTENTS) >= {"coding", "chat", "creative"}
    llama = book.resolve("coding", "llama").sampling
    qwen3 = book.resolve("coding", "qwen3").sampling
    assert llama["temperature"] == 0.2 and llama["top_p"] == 0.95
    assert qwen3["temperature"] == 0.7 and qwen3["top_k"] == 20
    assert book.resolve("deterministic", "qwen2").sampling_params().greedy


def test_user_profiles_replace_intents_and_stack_on_the_base():
    book = ProfileBook({"coding": Profile("coding", {"temperature": 0.05}, system="Code.")})
    p = book.resolve("coding", "gemma3")
    assert p.sampling["temperature"] == 0.05 and p.sampling["top_k"] == 64  # base kept
    assert p.system == "Code."


def test_explicit_values_win_and_none_is_unset():
    p = ProfileBook().resolve("creative", "llama")
    params = p.sampling_params({"temperature": 0.3, "top_p": None, "seed": 4})
    assert (params.temperature, params.top_p, params.seed) == (0.3, 0.95, 4)


def test_unknown_profile_lists_the_valid_ones():
    book = ProfileBook({"mine": Profile("mine")})
    with pytest.raises(UnknownProfileError) as err:
        book.resolve("nope", "llama")
    assert err.value.status == 400 and err.value.openai_type == "unknown_profile"
    assert "mine" in err.value.extra["valid_profiles"] and "coding" in str(err.value)


def test_profile_rejects_unknown_sampling_keys():
    with pytest.raises(ValueError):
        Profile("x", {"temprature": 1})


@pytest.mark.parametrize("family", [*FAMILY_BASE, "unknown"])
@pytest.mark.parametrize("name", [None, *BUILTIN_INTENTS])
def test_built_in_profiles_pass_the_engines_checks(name, family):
    """Built-in values meet the rules a request's and a YAML profile's values meet."""
    from gmlx.engine.sampling import validate

    model_type = family.replace("-", "_")
    validate(ProfileBook().resolve(name, model_type).sampling_params(), vocab_size=32000)
