"""The built-in ``demo`` model: tiny, random, deterministic, built offline.

A qwen2-architecture model (hidden 128, 2 layers) with seeded random weights and a
real byte-level BPE tokenizer trained with the ``tokenizers`` library on a corpus
shipped in this module, plus a ChatML template that renders tools and, with
``enable_thinking``, opens a ``<think>`` block for the model to reason in. It is built on
first use into the gmlx cache and reused afterwards; its text is meaningless, but
it exercises every code path a real model does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from gmlx.engine.loading.model import DEMO_ID, LoadedModel
from gmlx.paths import cache_dir

VERSION = 2  # bump whenever the built files change
SEED = 20261129

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<think>", "</think>"]
EOS_TOKEN = "<|im_end|>"

MODEL_CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([]) %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

# The tokenizer's training corpus: English prose, code, numbers and a little of
# several scripts, so common words are single tokens and everything else falls back
# to bytes (which exercises multi-byte detokenization).
_CORPUS = [
    (
        "The quick brown fox jumps over the lazy dog. A local model answers questions, "
        "writes code and calls tools for agents that run on your own machine."
    ),
    (
        "Hello, world! How are you today? I am fine, thank you. What is the weather like "
        "in Paris, London, Tokyo and New York? It is sunny and warm."
    ),
    (
        "def main(argv: list[str]) -> int:\n    for i in range(10):\n        print(i * 2)\n"
        "    return 0\n\nif __name__ == '__main__':\n    main([])\n"
    ),
    "function add(a, b) { return a + b; }\nconst x = [1, 2, 3].map((v) => v * 2);\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2026 3.14159 -7 1e9",
    "system user assistant tool function name arguments content role message",
    "Héllo wörld, café, naïve, résumé. Привет, мир. 你好，世界。こんにちは。안녕하세요. 🙂🎉",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;\n",
    "The memory governor keeps the server alive: green, yellow, orange and red bands.",
]


def demo_dir() -> Path:
    return cache_dir() / "models" / f"demo-v{VERSION}"


def _corpus() -> list[str]:
    # Repeat with variations so the BPE trainer sees enough pairs to merge.
    lines = []
    for n in range(40):
        for i, text in enumerate(_CORPUS):
            lines.append(text if (n + i) % 3 else text.lower())
    return lines


def build_tokenizer(specials: list[str] = SPECIAL_TOKENS):
    """Train the demo's byte-level BPE tokenizer (deterministic for a given corpus),
    with ``specials`` as its special tokens (ids 0, 1, ... in order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build(target: Path) -> None:
    """Write the demo model folder (config, weights, tokenizer) to ``target``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers import PreTrainedTokenizerFast

    from gmlx.engine.mlxlm import model_classes

    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS_TOKEN)
    config = dict(MODEL_CONFIG, vocab_size=vocab_size, eos_token_id=eos_id,
                  bos_token_id=None, torch_dtype="float32")

    mx.random.seed(SEED)
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    # With the default init a random model repeats one token and samples near
    # uniformly. Wider embeddings (untied) make greedy output vary with the
    # context, and a wider output head gives sampling a peaked distribution
    # (entropy ~2.4 nats), so sampler settings have visible effects.
    weights = dict(tree_flatten(model.parameters()))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 4.0
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8.0
    mx.eval(weights)

    def write(folder: Path) -> None:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token=EOS_TOKEN,
            pad_token="<|endoftext|>",
            clean_up_tokenization_spaces=False,
            model_max_length=MODEL_CONFIG["max_position_embeddings"],
        )
        hf.chat_template = CHAT_TEMPLATE
        hf.save_pretrained(str(folder))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))

    write_folder(target, write)


def write_folder(target: Path, write: Callable[[Path], None]) -> None:
    """Write a model folder at ``target`` through ``write`` (given an empty folder),
    atomically: a concurrent builder's complete result wins, never a half-written one."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(target: Path, build: Callable[[Path], None]) -> Path:
    """The model folder ``target``, built first with ``build`` if it is not complete."""
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a half-written folder from an older, interrupted gmlx
            shutil.rmtree(target, ignore_errors=True)
        try:
            build(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    return target


def ensure_built() -> Path:
    """The demo model folder, building it first if it is not in the cache yet."""
    return ensure(demo_dir(), build)


def load() -> LoadedModel:
    return load_built(ensure_built(), DEMO_ID)


def load_tokenizer():
    return load_built_tokenizer(ensure_built())


def load_built(folder: Path, model_id: str) -> LoadedModel:
    """A built-in model's folder, loaded as an MLX folder under its built-in id."""
    from gmlx.engine.loading.mlx_dir import load as load_folder

    loaded = load_folder(folder)
    loaded.id = model_id
    loaded.kind = "demo"
    return loaded


def load_built_tokenizer(folder: Path):
    from gmlx.engine.loading.mlx_dir import load_tokenizer as load_folder_tokenizer

    return load_folder_tokenizer(folder)
