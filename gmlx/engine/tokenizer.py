"""Tokenizers, chat templates, incremental detokenization and stop strings.

One :class:`Tokenizer` serves every model source: MLX folders load theirs from
``tokenizer.json``, GGUF files build a ``tokenizers`` tokenizer from their metadata,
and both end up wrapped in the same class the engine and ``gmlx.load_tokenizer`` use.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# transformers warns at import that PyTorch is absent; gmlx never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers import PreTrainedTokenizerFast

_REPLACEMENT = "\ufffd"

log = logging.getLogger("gmlx.engine")


class Tokenizer:
    """Text <-> token ids, the chat template and the special tokens of one model."""

    def __init__(
        self,
        hf: PreTrainedTokenizerFast,
        *,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf
        self._backend = hf.backend_tokenizer
        self._chat_encoder = PrefixReusingEncoder(self._backend)
        if chat_template is not None:
            hf.chat_template = chat_template
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @classmethod
    def from_dir(cls, path: Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from a model folder."""
        hf = PreTrainedTokenizerFast.from_pretrained(str(path))
        return cls(hf, eos_token_ids=eos_token_ids)

    @classmethod
    def from_tokenizers(
        cls,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> Tokenizer:
        """Wrap a ``tokenizers.Tokenizer`` built in memory (the GGUF path).

        ``add_bos_token``/``add_eos_token`` say whether ``encode(...,
        add_special_tokens=True)`` adds them; the tokenizer's post-processor must
        already implement that (GGUF builders set a TemplateProcessing).
        """
        special = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "unk_token": unk_token,
            "pad_token": pad_token,
            "clean_up_tokenization_spaces": False,
        }
        # The wrapper adopts ``tokenizer`` itself (and changes it: it adds the named
        # special tokens) instead of deep-copying it, which costs a JSON round trip of
        # the whole vocabulary (0.6 s for 128k tokens).
        hf = PreTrainedTokenizerFast(tokenizer_object=_Adopt(tokenizer), **special)
        if hf.backend_tokenizer is not tokenizer:  # a transformers that copies otherwise
            hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
        hf.add_bos_token = add_bos_token  # informational for templates
        return cls(hf, eos_token_ids=eos_token_ids, chat_template=chat_template)

    # -- encoding -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token(self) -> str | None:
        return self.hf.bos_token

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token(self) -> str | None:
        return self.hf.eos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # Straight to the Rust tokenizer: what transformers' decode does with clean-up
        # off, without its per-call Python conversions (the detokenizer calls this twice
        # per generated token; on an accelerator that shows in the decode rate).
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        tid = self.hf.convert_tokens_to_ids(token)
        return None if tid is None or tid == self.hf.unk_token_id and token != self.hf.unk_token else tid

    # -- chat ---------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render messages through the model's chat template (no template: plain text)."""
        if not self.chat_template:
            return _plain_chat(messages, add_generation_prompt)
        return self.hf.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render and tokenize a conversation; special tokens come from the template."""
        text = self.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        ids = self._chat_encoder.encode(text)
        bos = self.bos_token_id
        if (
            bos is not None
            and getattr(self.hf, "add_bos_token", False)
            and (not ids or ids[0] != bos)
        ):
            ids = [bos, *ids]
        return ids

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class _Adopt:
    """Hands a ``tokenizers.Tokenizer`` to ``PreTrainedTokenizerFast(tokenizer_object=...)``,
    which deep-copies that argument: the copy of this object is the tokenizer itself."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.tokenizer


class PrefixReusingEncoder:
    """Tokenizes a rendered conversation reusing the tokens of the longest head it
    shares with a recent one: an agent resends its whole history every turn, and only
    what follows the shared head needs tokenizing again (a 2k-token prompt costs ~3 ms
    to tokenize on a slow CPU, a long agent history tens of milliseconds).

    The head is cut just before a special token (``<|im_start|>`` and the like) that
    both texts hold at the same place. A tokenizer splits its input at such tokens
    before anything else and tokenizes the pieces between them on their own, so the
    rest tokenized alone gives the tokens the whole would. Only special tokens that
    match exactly (not normalized, not stripping the whitespace before them) are cut
    points. The first ``VERIFY`` reuses are checked: the text from the cut point before
    the one used (or from the start) is tokenized whole and must give the tokens the
    reuse gave from there, so the cut is tested with the text that precedes it up to the
    last point no tokenizer looks past. A mismatch turns reuse off for this tokenizer.
    The check costs the last shared message and the new text, not the whole history.
    """

    KEEP = 8  # recent texts remembered
    VERIFY = 4  # the first reuses, checked from the cut point before theirs

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        # text -> (ids, cut points as (start char, end char, token index))
        self._recent: OrderedDict[str, tuple[list[int], list[tuple[int, int, int]]]] = OrderedDict()
        self._verified = 0
        self.reused_tokens = 0
        try:
            decoder = backend.get_added_tokens_decoder()
        except AttributeError:  # an old tokenizers: no reuse
            decoder = {}
        self._cut_ids = frozenset(
            i for i, t in decoder.items() if t.special and not t.normalized and not t.lstrip
        )
        self.enabled = bool(self._cut_ids)

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._full(text)
        with self._lock:
            head = self._best_head(text)
        if head is None:
            ids, cuts = self._encode(text, 0, 0)
        else:
            head_ids, head_cuts, cut = head
            tail_ids, tail_cuts = self._encode(text[cut:], cut, len(head_ids))
            ids, cuts = head_ids + tail_ids, head_cuts + tail_cuts
            if self._verified < self.VERIFY:
                start, _, index = head_cuts[-1] if head_cuts else (0, 0, 0)
                if self._full(text[start:]) != ids[index:]:
                    log.warning("tokenizing after a shared head changed the tokens; reuse is off")
                    self.enabled = False
                    return self._full(text)
                self._verified += 1
            self.reused_tokens += len(head_ids)
        with self._lock:
            self._recent[text] = (ids, cuts)
            self._recent.move_to_end(text)
            while len(self._recent) > self.KEEP:
                self._recent.popitem(last=False)
        return list(ids)

    def _full(self, text: str) -> list[int]:
        return list(self._tokenize(text).ids)

    def _tokenize(self, text: str) -> Any:
        """The Rust tokenizer's encoding of ``text``, taken through ``encode_batch``:
        the same tokens as ``encode``, but it releases the GIL while it works, where
        ``encode`` holds it throughout. A long prompt (a 30k-token agent history takes
        tens of milliseconds) then tokenizes on its thread while the model workers keep
        decoding and the event loop keeps streaming."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0]

    def _encode(self, text: str, at: int, first: int) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Tokens of ``text`` (found at char ``at`` of the whole, its first token being
        token ``first``) and its cut points in the whole's coordinates."""
        enc = self._tokenize(text)
        ids = list(enc.ids)
        # Offsets of the cut tokens alone: ``enc.offsets`` would build a tuple for every
        # token while holding the GIL (30 ms for an 80k-token history).
        cuts = []
        for k in [k for k, i in enumerate(ids) if i in self._cut_ids]:
            span = enc.token_to_chars(k)
            if span is not None and first + k > 0:
                cuts.append((at + span[0], at + span[1], first + k))
        return ids, cuts

    def _best_head(self, text: str) -> tuple[list[int], list[tuple[int, int, int]], int] | None:
        """The longest reusable head: its tokens, its cut points and the char where the
        rest starts (caller holds the lock)."""
        best: tuple[list[int], list[tuple[int, int, int]], int] | None = None
        for seen, (ids, cuts) in self._recent.items():
            shared = _common_prefix(text, seen)
            # The cut token must lie wholly inside the shared text, so that ``text``
            # holds it at the same place.
            j = bisect.bisect_right([end for _, end, _ in cuts], shared) - 1
            if j < 0:
                continue
            start, _, index = cuts[j]
            if best is None or start > best[2]:
                best = (ids[:index], cuts[:j], start)
        return best


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two strings, by bisection on C-speed compares."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _plain_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never split a character.

    Works for every tokenizer (byte-level BPE, SentencePiece with its leading-space
    rule, byte-fallback tokens) because it compares decodes of a short window
    instead of decoding tokens one at a time: text is released only when the
    window's decode does not end in a replacement character, i.e. when the bytes of
    the last character are complete.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully released
        self._read = 0  # tokens up to here have had their text released

    def add(self, token: int) -> str:
        """Add one token; returns the new complete text (possibly empty)."""
        self.tokens.append(token)
        prefix_text = self._tok.decode(self.tokens[self._prefix : self._read])
        full_text = self._tok.decode(self.tokens[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.tokens)
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._tok.decode(self.tokens[self._prefix : self._read])
        full_text = self._tok.decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return full_text[len(prefix_text) :]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``:
    how much text to hold back because it may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StopMatcher:
    """Holds back text that could be the start of a stop string.

    ``feed`` returns the text safe to emit and whether a stop string was hit; the
    stop string itself and anything after it are never returned.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            self._held = ""
            self.stopped = True
            return buf[:cut], True
        keep = max((partial_suffix(buf, stop) for stop in self.stops), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out
