"""Tokenizers rebuilt from GGUF metadata, against llama.cpp's own vocab files.

Reference ids: "Hello world" is the first case of llama.cpp's test-tokenizer-0 for these
vocab files ([15043, 3186] llama-spm, [9906, 1917] llama-bpe, [9707, 1879] qwen2). Every
other expected id is looked up in the file's own ``tokenizer.ggml.tokens``, i.e. the
piece the text must become (the vocab files carry no embedded test strings).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gmlx
from gmlx.engine.errors import UnsupportedModelError
from gmlx.engine.loading.gguf_file import GGUFFile
from gmlx.engine.loading.gguf_tokenizer import build_tokenizer
from gmlx.engine.tokenizer import Tokenizer
from tests.conftest import VOCAB_DIR, VOCABS

CORPUS = [
    "Hello world",
    " Hello world",
    "   three leading spaces",
    "trailing   ",
    "tabs\tand\t\ttabs",
    "line\nbreaks\n\n\nand\r\nCRLF",
    "Ünïcödé façade naïve — “quotes” ‘single’ …",
    "emoji 🦙🔥👩‍👩‍👧 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "numbers 3 33 333 3333 33333 1234567890 3.14159 -42 1e-9",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\tpass",
    '<html><body class="x">&amp;</body></html>',
    "I'm sure you'll see we've done it, they'd say; HE'S RIGHT",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="session")
def vocab_tokenizers() -> dict[str, Tokenizer]:
    if not VOCAB_DIR.is_dir():
        pytest.skip(f"llama.cpp vocab fixtures not found at {VOCAB_DIR.resolve()}")
    return {n: gmlx.load_tokenizer(VOCAB_DIR / f"ggml-vocab-{n}.gguf") for n in VOCABS}


def _id(tok: Tokenizer, piece: str) -> int:
    tid = tok.token_to_id(piece)
    assert tid is not None, piece
    return tid


@pytest.mark.parametrize("name", VOCABS)
def test_round_trip(vocab_tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = vocab_tokenizers[name]
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, (name, text, ids)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("llama-spm", [15043, 3186]), ("llama-bpe", [9906, 1917]), ("qwen2", [9707, 1879])],
)
def test_llama_cpp_reference_ids(
    vocab_tokenizers: dict[str, Tokenizer], name: str, expected: list[int]
) -> None:
    assert vocab_tokenizers[name].encode("Hello world", add_special_tokens=False) == expected


@pytest.mark.parametrize(
    ("name", "pieces"),
    [
        ("qwen2", ["Hello", "Ġworld"]),
        ("llama-bpe", ["Hello", "Ġworld"]),
        ("llama-spm", ["▁Hello", "▁world"]),
        ("phi-3", ["▁Hello", "▁world"]),
        ("gemma-4", ["Hello", "▁world"]),
    ],
)
def test_simple_words_are_their_vocab_pieces(
    vocab_tokenizers: dict[str, Tokenizer], name: str, pieces: list[str]
) -> None:
    tok = vocab_tokenizers[name]
    assert tok.encode("Hello world", add_special_tokens=False) == [_id(tok, p) for p in pieces]


@pytest.mark.parametrize(
    ("name", "bos"),
    [("qwen2", None), ("llama-bpe", 128000), ("llama-spm", 1), ("phi-3", 1), ("gemma-4", 2)],
)
def test_bos_follows_add_bos_token(
    vocab_tokenizers: dict[str, Tokenizer], name: str, bos: int | None
) -> None:
    tok = vocab_tokenizers[name]
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == ([bos] if bos is not None else []) + plain


@pytest.mark.parametrize(
    ("name", "eog"),
    [
        ("qwen2", "<|im_end|>"),
        ("llama-bpe", "<|eot_id|>"),
        ("llama-spm", "</s>"),
        ("phi-3", "<|end|>"),
        ("gemma-4", "<turn|>"),
    ],
)
def test_end_of_generation_tokens(
    vocab_tokenizers: dict[str, Tokenizer], name: str, eog: str
) -> None:
    tok = vocab_tokenizers[name]
    assert _id(tok, eog) in tok.eos_token_ids


@pytest.mark.parametrize(
    ("name", "special"),
    [
        ("qwen2", "<|im_start|>"),
        ("llama-bpe", "<|start_header_id|>"),
        ("phi-3", "<|user|>"),
        ("gemma-4", "<|turn>"),
    ],
)
def test_special_tokens_in_text_are_one_token(
    vocab_tokenizers: dict[str, Tokenizer], name: str, special: str
) -> None:
    tok = vocab_tokenizers[name]
    ids = tok.encode(f"{special}user", add_special_tokens=False)
    assert ids[0] == _id(tok, special)
    assert tok.decode(ids).startswith(special)


def test_spm_prefixes_a_space_after_special_tokens(vocab_tokenizers: dict[str, Tokenizer]) -> None:
    tok = vocab_tokenizers["llama-spm"]
    assert tok.encode("</s>Hello", add_special_tokens=False) == [2, _id(tok, "▁Hello")]


def test_spm_byte_fallback(vocab_tokenizers: dict[str, Tokenizer]) -> None:
    tok = vocab_tokenizers["llama-spm"]
    ids = tok.encode("🦙", add_special_tokens=False)
    assert [tok.hf.convert_ids_to_tokens(i) for i in ids] == [
        "▁",
        "<0xF0>",
        "<0x9F>",
        "<0xA6>",
        "<0x99>",
    ]


def test_chat_templates_render(vocab_tokenizers: dict[str, Tokenizer]) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    qwen = vocab_tokenizers["qwen2"]
    assert qwen.render_chat(messages).endswith(
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = qwen.encode_chat(messages)
    assert ids.count(_id(qwen, "<|im_start|>")) == 3
    phi = vocab_tokenizers["phi-3"]
    assert phi.render_chat(messages) == "<s><|user|>\nHi there<|end|>\n<|assistant|>\n"
    assert phi.encode_chat(messages)[:2] == [1, _id(phi, "<|user|>")]
    gemma = vocab_tokenizers["gemma-4"]
    text = gemma.render_chat(messages)
    assert "<|turn>user\nHi there<turn|>" in text and text.rstrip().endswith("<channel|>")
    assert gemma.encode_chat(messages)[0] == 2


def _metadata(name: str) -> dict:
    if not VOCAB_DIR.is_dir():
        pytest.skip(f"llama.cpp vocab fixtures not found at {VOCAB_DIR.resolve()}")
    return GGUFFile(VOCAB_DIR / f"ggml-vocab-{name}.gguf").metadata


def test_unsupported_tokenizer_model_names_it(tmp_path: Path) -> None:
    metadata = {**_metadata("llama-spm"), "tokenizer.ggml.model": "rwkv"}
    with pytest.raises(UnsupportedModelError, match="'rwkv'.*supported: gpt2, llama, gemma4"):
        build_tokenizer(tmp_path / "x.gguf", metadata)


def test_unsupported_pre_tokenizer_names_it(tmp_path: Path) -> None:
    metadata = {
        **_metadata("llama-spm"),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "mystery",
    }
    with pytest.raises(UnsupportedModelError, match="'mystery'.*qwen2"):
        build_tokenizer(tmp_path / "x.gguf", metadata)


TRICKY = [
    "Hi there",
    "  two leading spaces\n\nand blank lines\t\ttabs",
    "unicode: 東京 • Zürich — naïve 😀 ",
    "looks special: <|im_ <|im_start <| |> <s> </s> <end>",
    "code:\n```python\ndef f(x):\n    return x + 1\n```\n",
    "",
]


@pytest.mark.parametrize("verify", [0, 1000])
@pytest.mark.parametrize("name", VOCABS)
def test_chat_tokens_reused_from_a_shared_head_are_the_full_tokens(
    vocab_tokenizers: dict[str, Tokenizer], name: str, verify: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation that grows turn by turn, and one that branches off it, tokenize
    to exactly what tokenizing the whole text gives: with the safety check off (a
    difference would show here instead of being caught), and with every reuse checked
    (the check never raises a false alarm that would turn reuse off)."""
    from gmlx.engine.tokenizer import PrefixReusingEncoder

    monkeypatch.setattr(PrefixReusingEncoder, "VERIFY", verify)
    tok = vocab_tokenizers[name]
    tok._chat_encoder = PrefixReusingEncoder(tok._backend)  # fresh: no texts of other tests

    def full(messages: list[dict[str, str]]) -> list[int]:
        ids = tok.encode(tok.render_chat(messages), add_special_tokens=False)
        bos = tok.bos_token_id
        if bos is not None and getattr(tok.hf, "add_bos_token", False) and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    conversation = [{"role": "system", "content": "You are terse. " * 20}]
    for i, text in enumerate(TRICKY):
        conversation.append({"role": "user", "content": text})
        assert tok.encode_chat(conversation) == full(conversation), (name, i)
        branch = [*conversation[:-1], {"role": "user", "content": text + " (edited)"}]
        assert tok.encode_chat(branch) == full(branch), (name, i, "branch")
        conversation.append({"role": "assistant", "content": TRICKY[-1 - i] or "ok"})
    cut_points = [i for i in full(conversation)[1:] if i in tok._chat_encoder._cut_ids]
    assert (tok._chat_encoder.reused_tokens > 0) == bool(cut_points)  # templates with special tokens reuse
    assert tok._chat_encoder.enabled == bool(tok._chat_encoder._cut_ids)
