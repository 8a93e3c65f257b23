"""A GGUF's built tokenizer (:class:`TokenizerSpec`) as bytes and back, fast to read.

``tokenizer.json`` would do, but ``tokenizers`` parses a 128k-token vocabulary with
280k merges from JSON in ~0.5 s on a small CPU: slower than building it from the GGUF.
This form holds what the BPE model is built from (vocab dict, merge pairs, the model's
settings) in ``marshal``, the rest of the pipeline (normalizer, pre-tokenizer,
post-processor, decoder) as a small ``tokenizer.json`` around an empty model, and the
added tokens with their ids; reading it calls the same constructors a build does
(~0.3 s). The converted-weights cache checks the bytes' sha256 before :func:`load`.
"""

from __future__ import annotations

import json
import marshal
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from gmlx.engine.loading.gguf_tokenizer import TokenizerSpec

FORMAT = 1
_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
_MODEL = (  # BPE settings, each a getter and a constructor argument of the same name
    "dropout",
    "unk_token",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "fuse_unk",
    "byte_fallback",
    "ignore_merges",
)
_ADDED = ("single_word", "lstrip", "rstrip", "normalized", "special")


def dump(spec: TokenizerSpec) -> bytes:
    """``spec`` as bytes (before its tokenizer is wrapped: the wrapper adds tokens)."""
    hf = spec.backend
    if not isinstance(hf.model, BPE):
        raise TypeError(f"only BPE tokenizers are stored, not {type(hf.model).__name__}")
    shell = HFTokenizer(BPE())
    for part in _PARTS:
        if (value := getattr(hf, part)) is not None:
            setattr(shell, part, value)
    added = [
        (i, t.content, *(bool(getattr(t, k)) for k in _ADDED))
        for i, t in sorted(hf.get_added_tokens_decoder().items())
    ]
    body = {
        "format": FORMAT,
        "vocab": hf.get_vocab(with_added_tokens=False),
        "merges": [(str(a), str(b)) for a, b in spec.merges],
        "model": {k: getattr(hf.model, k) for k in _MODEL},
        "pipeline": shell.to_str(),
        "added": added,
        "options": json.dumps(spec.options),
    }
    return marshal.dumps(body)


def load(data: bytes) -> TokenizerSpec:
    """The spec :func:`dump` wrote; ValueError, TypeError or a ``tokenizers`` error when
    ``data`` is not one."""
    body = marshal.loads(data)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a stored tokenizer of this format")
    vocab, merges, model, added = body["vocab"], body["merges"], body["model"], body["added"]
    if not (isinstance(vocab, dict) and isinstance(merges, list) and isinstance(added, list)):
        raise TypeError("the stored vocab, merges or added tokens have the wrong type")
    if not isinstance(model, dict) or set(model) != set(_MODEL):
        raise ValueError(f"the stored BPE settings {model!r} are not {_MODEL}")
    hf = HFTokenizer(BPE(vocab, merges, **{k: v for k, v in model.items() if v is not None}))
    shell = HFTokenizer.from_str(body["pipeline"])
    for part in _PARTS:
        if (value := getattr(shell, part)) is not None:
            setattr(hf, part, value)
    _add_tokens(hf, added)
    options: dict[str, Any] = json.loads(body["options"])
    return TokenizerSpec(hf, merges, options)


def _add_tokens(hf: HFTokenizer, added: list[tuple[Any, ...]]) -> None:
    """Add the stored added tokens in id order, each run of special or plain ones in one
    call (as the JSON form's reader does), and check each got its stored id."""
    run: list[AddedToken] = []
    for n, (_, content, *flags) in enumerate(added):
        run.append(AddedToken(content, **dict(zip(_ADDED, flags, strict=True))))
        if n + 1 == len(added) or bool(added[n + 1][-1]) != bool(flags[-1]):
            (hf.add_special_tokens if flags[-1] else hf.add_tokens)(run)
            run = []
    for tid, content, *_ in added:
        if hf.token_to_id(content) != tid:
            raise ValueError(f"added token {content!r} has id {hf.token_to_id(content)}, not {tid}")
