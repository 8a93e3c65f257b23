"""Tokenizers from GGUF metadata (``tokenizer.ggml.*``), built in memory without torch.

Three tokenizer models, each rebuilt as a ``tokenizers`` pipeline that tokenizes the way
llama.cpp does:

- ``gpt2``: byte-level BPE. The ``tokenizer.ggml.pre`` name picks the regex that splits
  text into words before the merges (:data:`PRE_TOKENIZER_REGEXES`).
- ``llama``: SentencePiece. Spaces become ``▁`` and a ``▁`` is prepended to each run of
  text (llama.cpp also does so after every special token); pieces merge greedily by the
  score of the merged piece, which is BPE with merges ranked by that score; characters
  with no piece fall back to ``<0xXX>`` byte tokens.
- ``gemma4``: BPE over raw UTF-8 with ``▁`` for spaces, merges given in the file, text
  split into newline and non-newline runs first, byte fallback.

Control and user-defined tokens become added tokens matched before the model runs.

:func:`build_spec` stops before the wrapper: a :class:`TokenizerSpec` (the ``tokenizers``
pipeline, its BPE merges and the wrapper's options), which ``tokenizer_blob`` turns into
bytes and back, so the converted-weights cache keeps it beside the weights and a cached
load skips the rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.tokenizer import Tokenizer

SPACE = "\u2581"  # SentencePiece's visible space
# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> word-splitting regex of the gpt2 (byte-level BPE) model. Files
# without a ``pre`` (old conversions) use GPT-2's own regex, as "default" does here.
PRE_TOKENIZER_REGEXES: dict[str, str] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "tekken": _TEKKEN,
}
# llama3-style vocabularies look a whole word up before merging (llama.cpp ignore_merges).
_IGNORE_MERGES = {"llama-bpe", "llama3", "smaug-bpe", "dbrx"}
# Pre-tokenizers for which llama.cpp adds BOS when the file does not say.
_BOS_BY_DEFAULT = {"llama-bpe", "llama3", "smaug-bpe", "dbrx", "tekken"}
# End-of-generation tokens llama.cpp recognises by name besides the declared EOS.
_EOG_NAMES = {
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<turn|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
}
SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")


def _ids(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


# The keyword arguments of Tokenizer.from_tokenizers a TokenizerSpec carries.
_OPTIONS = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "eos_token_ids",
        "chat_template",
        "add_bos_token",
        "add_eos_token",
    }
)


@dataclass
class TokenizerSpec:
    """A GGUF's tokenizer before wrapping: the ``tokenizers`` pipeline (a BPE model), the
    merges its model was built from (``tokenizers`` has no getter for them) and the
    keyword arguments of :meth:`Tokenizer.from_tokenizers` (special tokens, EOG ids,
    template).

    :meth:`tokenizer` hands ``backend`` to the wrapper, which changes it in place (it adds
    the named special tokens): serialize the spec first when both are wanted.
    """

    backend: HFTokenizer
    merges: list[tuple[str, str]]
    options: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.options, dict) or self.options.keys() != _OPTIONS:
            raise ValueError(f"tokenizer options {self.options!r} lack or add keys")
        ids = self.options["eos_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"eos_token_ids {ids!r} is not a list of ids")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_tokenizers(self.backend, **self.options)


def build_tokenizer(path: Path, metadata: dict[str, Any]) -> Tokenizer:
    """The :class:`Tokenizer` a GGUF's metadata describes, chat template included."""
    return build_spec(path, metadata).tokenizer()


def build_spec(path: Path, metadata: dict[str, Any]) -> TokenizerSpec:
    """The :class:`TokenizerSpec` a GGUF's metadata describes."""
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise ModelSourceError(f"{path} has no tokenizer (tokenizer.ggml.* metadata is missing).")
    if model not in SUPPORTED_MODELS:
        raise UnsupportedModelError(
            f"{path}: GGUF tokenizer model {model!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODELS)})."
        )
    types = np.asarray(metadata.get("tokenizer.ggml.token_type", np.full(len(tokens), NORMAL)))
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if model == "gpt2":
        (hf, merges), add_bos_default = (
            _byte_level_bpe(path, metadata, tokens, pre),
            pre in _BOS_BY_DEFAULT,
        )
    elif model == "llama":
        (hf, merges), add_bos_default = _sentencepiece(metadata, tokens, types), True
    else:
        (hf, merges), add_bos_default = _gemma4(metadata, tokens), True

    special = [
        AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False, rstrip=rstrip)
        for i, rstrip in _added_token_ids(metadata, tokens, types)
    ]
    hf.add_special_tokens(special)

    bos_id, eos_id, unk_id = (
        _ids(metadata, "bos_token_id"),
        _ids(metadata, "eos_token_id"),
        _ids(metadata, "unknown_token_id"),
    )
    add_bos = (
        bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
    )
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    _set_post_processor(hf, tokens, bos_id if add_bos else None, eos_id if add_eos else None)

    def name(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    template = metadata.get("tokenizer.chat_template")
    options = {
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "unk_token": name(unk_id),
        "pad_token": name(_ids(metadata, "padding_token_id")),
        "eos_token_ids": _eog_ids(metadata, tokens, types),
        "chat_template": None if template is None else str(template),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    return TokenizerSpec(hf, merges, options)


def _added_token_ids(
    metadata: dict[str, Any], tokens: list[str], types: np.ndarray
) -> list[tuple[int, bool]]:
    """Ids of control and user-defined tokens, with llama.cpp's rstrip choice for each."""
    ids = np.nonzero((types == CONTROL) | (types == USER_DEFINED))[0].tolist()
    # llama.cpp strips whitespace after Phi-3's special tokens (as its HF tokenizer does).
    name = str(metadata.get("general.name", "")).lower()
    phi3 = "phi-3" in name or "phi3" in name
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    out = []
    for i in ids:
        if tokens[i]:
            out.append((i, phi3 and (tokens[i] not in keep)))
    return out


def _eog_ids(metadata: dict[str, Any], tokens: list[str], types: np.ndarray) -> list[int]:
    """EOS, EOT and EOM ids from the metadata, plus control tokens llama.cpp treats as EOG."""
    ids = {_ids(metadata, k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")}
    for i in np.nonzero(types == CONTROL)[0].tolist():
        if tokens[i] in _EOG_NAMES:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def _set_post_processor(
    hf: HFTokenizer, tokens: list[str], bos_id: int | None, eos_id: int | None
) -> None:
    """Make ``encode(..., add_special_tokens=True)`` add BOS/EOS as the file says."""
    if bos_id is None and eos_id is None:
        return
    bos = [f"{tokens[bos_id]}:0"] if bos_id is not None else []
    eos = [f"{tokens[eos_id]}:0"] if eos_id is not None else []
    pair_bos = [f"{tokens[bos_id]}:1"] if bos_id is not None else []
    pair_eos = [f"{tokens[eos_id]}:1"] if eos_id is not None else []
    specials = [(tokens[i], i) for i in {bos_id, eos_id} if i is not None]
    hf.post_processor = processors.TemplateProcessing(
        single=" ".join([*bos, "$A:0", *eos]),
        pair=" ".join([*bos, "$A:0", *eos, *pair_bos, "$B:1", *pair_eos]),
        special_tokens=specials,
    )


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a duplicated piece keeps its first (lowest) id
    return vocab


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """``"a b"`` merge rules as pairs; the separator is the first space after the first
    character, so a piece that is itself a space still parses."""
    pairs = []
    for rule in merges:
        cut = rule.find(" ", 1)
        if cut > 0:
            pairs.append((rule[:cut], rule[cut + 1 :]))
    return pairs


_Built = tuple[HFTokenizer, list[tuple[str, str]]]  # a pipeline and its model's merges


def _byte_level_bpe(path: Path, metadata: dict[str, Any], tokens: list[str], pre: str) -> _Built:
    if pre not in PRE_TOKENIZER_REGEXES:
        raise UnsupportedModelError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZER_REGEXES)})."
        )
    merges = _split_merges(metadata.get("tokenizer.ggml.merges", []))
    hf = HFTokenizer(
        BPE(_vocab(tokens), merges, ignore_merges=pre in _IGNORE_MERGES, fuse_unk=False)
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEXES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    return hf, merges


def sentencepiece_merges(
    tokens: list[str], scores: np.ndarray, types: np.ndarray
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's greedy best-score-first joining.

    Every way to cut a normal piece into two pieces of the vocabulary is a merge; merges
    are ranked by the score of the piece they make (higher first), then by its id.
    """
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[pid]), pid, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], types: np.ndarray) -> _Built:
    scores = np.asarray(metadata.get("tokenizer.ggml.scores", np.zeros(len(tokens))))
    unk_id = _ids(metadata, "unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    merges = sentencepiece_merges(tokens, scores, types)
    hf = HFTokenizer(
        BPE(
            _vocab(tokens),
            merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prepend = metadata.get("tokenizer.ggml.add_space_prefix", True)
    hf.normalizer = _space_normalizer(prepend)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prepend:
        decode.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(decode)
    return hf, merges


def _space_normalizer(prepend: bool) -> normalizers.Normalizer:
    """Spaces as SentencePiece's ``▁``, with one prepended to the text when ``prepend``."""
    steps = [normalizers.Replace(" ", SPACE)]
    if prepend:
        steps.insert(0, normalizers.Prepend(SPACE))
    return normalizers.Sequence(steps)


def _gemma4(metadata: dict[str, Any], tokens: list[str]) -> _Built:
    merges = _split_merges(metadata.get("tokenizer.ggml.merges", []))
    unk_id = _ids(metadata, "unknown_token_id")
    hf = HFTokenizer(
        BPE(
            _vocab(tokens),
            merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    hf.normalizer = _space_normalizer(metadata.get("tokenizer.ggml.add_space_prefix", False))
    # Merges never cross a newline boundary: newline runs and other runs are split first.
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return hf, merges
