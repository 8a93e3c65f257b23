"""`gmlx run` and the root command, through Typer's CliRunner and as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from gmlx.cli.main import app
from gmlx.engine.types import FinishReason, SamplingParams

runner = CliRunner()


def gmlx(*args: str, input: str | None = None, env: dict[str, str] | None = None):
    """Run the CLI as a real process (stdout and stderr kept apart)."""
    return subprocess.run(
        [sys.executable, "-m", "gmlx.cli.main", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,  # the tests read the exit code
    )


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ["run", "serve", "launch", "estimate", "plan", "keep", "unload", "top"]:
        assert name in result.output


def test_one_shot_prints_the_answer_alone(demo_model):
    args = ["run", "demo", "-p", "Hello", "--max-tokens", "12", "--seed", "3", "--temperature", "0.8"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, args)
    assert first.stdout == again.stdout  # same seed, same prompt
    assert first.stdout.endswith("\n") and len(first.stdout) > 1


def test_one_shot_as_a_process_pipes_clean_stdout(demo_model):
    result = gmlx("run", "demo", "-p", "Hello", "-n", "10", "-t", "0")
    assert result.returncode == 0, result.stderr
    # stdout carries the model's answer and nothing else: no status line, no colour.
    expected = _greedy_answer(demo_model, "Hello", 10)
    assert result.stdout == expected + "\n"
    assert "\x1b[" not in result.stdout


def _greedy_answer(demo_model, text: str, n: int, system: str | None = None) -> str:
    from gmlx.engine.types import GenerateRequest
    from gmlx.engine.worker import ModelWorker

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    worker = ModelWorker(demo_model, decode_batch=1)
    try:
        tokens = tuple(demo_model.tokenizer.encode_chat(messages))
        events = worker.generate(GenerateRequest(tokens, max_tokens=n, sampling=SamplingParams(temperature=0)))
        return "".join(e.text for e in events)
    finally:
        worker.close()


def test_system_prompt_changes_the_answer(demo_model):
    plain = runner.invoke(app, ["run", "demo", "-p", "Hello", "-n", "12", "-t", "0"])
    with_system = runner.invoke(app, ["run", "demo", "-p", "Hello", "-n", "12", "-t", "0", "--system", "Answer in French."])
    assert with_system.stdout == _greedy_answer(demo_model, "Hello", 12, system="Answer in French.") + "\n"
    assert plain.stdout != with_system.stdout


def test_bad_model_path_is_one_sentence_exit_1(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = gmlx("run", str(missing), "-p", "hi")
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0] and "nope.gguf" in lines[0]
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(tmp_path):
    result = gmlx("run", str(tmp_path / "nope"), "-p", "hi", env={"GMLX_DEBUG": "1"})
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "does not exist" in result.stderr


def test_empty_prompt_and_bad_options_fail_cleanly():
    empty = gmlx("run", "demo", "-p", "  ")
    assert empty.returncode == 1 and "empty" in empty.stderr and "Traceback" not in empty.stderr
    bad = gmlx("run", "demo", "-p", "hi", "--max-tokens", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_prompt_longer_than_the_context_is_one_sentence():
    result = gmlx("run", "demo", "-p", "hello " * 5000, "-n", "4")
    assert result.returncode == 1
    assert "prompt is too long" in result.stderr and "Traceback" not in result.stderr


def test_interactive_chat_keeps_history_and_resets(demo_model):
    script = "Hello\n/reset\nHello\nnext turn\n/unknown\n/exit\n"
    result = runner.invoke(app, ["run", "demo", "-n", "6", "-t", "0"], input=script)
    assert result.exit_code == 0, result.output
    first = _greedy_answer(demo_model, "Hello", 6)
    assert result.output.count(first) == 2  # the same answer before and after /reset
    assert "Conversation cleared." in result.output
    assert "Unknown command /unknown" in result.output


def test_chat_leaves_on_end_of_input():
    result = runner.invoke(app, ["run", "demo", "-n", "4"], input="Hello\n")
    assert result.exit_code == 0


def test_ctrl_c_stops_the_answer_and_keeps_the_worker(demo_model):
    """Ctrl-C during an answer cancels the request; the next answer runs normally."""
    from gmlx.cli.run import stream_answer
    from gmlx.compose import build_engine, build_registry
    from gmlx.config import Settings
    from gmlx.engine.types import ChatRequest, Message

    settings, _ = Settings().with_models(["demo"])
    engine = build_engine(settings, build_registry(settings, decode_batch=1, warmup=False))
    written: list[str] = []

    def interrupting_write(text: str) -> None:
        written.append(text)
        if len(written) == 2:
            raise KeyboardInterrupt

    def turn(max_tokens: int) -> ChatRequest:
        return ChatRequest(model="demo", messages=(Message.text("user", "Hello"),),
                           sampling={"temperature": 0}, max_tokens=max_tokens)

    try:
        # The write raises inside the loop; stream_answer must treat it like Ctrl-C.
        answer, finish = stream_answer(engine.start_sync(turn(500)), write=interrupting_write)
        assert finish is FinishReason.CANCELLED
        assert answer == "".join(written)
        assert len(written) < 500
        answer, finish = stream_answer(engine.start_sync(turn(5)), write=lambda t: None)
        assert finish is FinishReason.LENGTH and answer
    finally:
        engine.registry.close()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("gmlx ")


def test_json_schema_flag_constrains_the_answer(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for seed in ("1", "2"):
        result = runner.invoke(app, ["run", "demo", "-p", "number", "--json-schema", str(path), "-t", "1",
                                     "--seed", seed, "-n", "40"])
        assert result.exit_code == 0, result.output
        assert 0 <= json.loads(result.stdout)["n"] <= 9


def test_bad_json_schema_files_are_one_sentence(tmp_path):
    missing = gmlx("run", "demo", "-p", "x", "--json-schema", str(tmp_path / "none.json"))
    assert missing.returncode == 2 or (missing.returncode == 1 and "Traceback" not in missing.stderr)
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    result = gmlx("run", "demo", "-p", "x", "--json-schema", str(broken))
    assert result.returncode == 1 and "not valid JSON" in result.stderr and "Traceback" not in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "bogus"}')
    result = gmlx("run", "demo", "-p", "x", "--json-schema", str(bad))
    assert result.returncode == 1 and "Invalid JSON schema" in result.stderr


def test_logprobs_flag_prints_a_table_on_stderr():
    result = gmlx("run", "demo", "-p", "hi", "--logprobs", "-n", "4", "-t", "0")
    assert result.returncode == 0, result.stderr
    assert "logprob" in result.stderr and "alternatives" in result.stderr
    assert "logprob" not in result.stdout  # stdout is the answer alone


def test_sampler_flags_change_the_answer():
    base = ["run", "demo", "-p", "Hello", "-n", "12", "-t", "1", "--seed", "5"]
    plain = runner.invoke(app, base).stdout
    greedy = runner.invoke(app, ["run", "demo", "-p", "Hello", "-n", "12", "-t", "0"]).stdout
    assert runner.invoke(app, [*base, "--top-k", "1"]).stdout == greedy
    assert runner.invoke(app, [*base, "--min-p", "0.999"]).stdout == greedy
    assert plain != greedy


def test_think_flag_shows_reasoning_on_stderr():
    plain = gmlx("run", "demo", "-p", "hi", "-n", "8", "-t", "0")
    result = gmlx("run", "demo", "-p", "hi", "--think", "--thinking-budget", "3", "-n", "8", "-t", "0")
    assert result.returncode == 0, result.stderr
    assert plain.stderr == "" and result.stderr.strip()  # the reasoning, dimmed on stderr
    assert "<think>" not in result.stdout and "</think>" not in result.stdout


def _image(path, color: str) -> str:
    from PIL import Image

    Image.new("RGB", (48, 40), color).save(path)
    return str(path)


def test_one_shot_with_an_image_conditions_on_it(tmp_path):
    red, blue = _image(tmp_path / "red.png", "red"), _image(tmp_path / "blue.jpg", "blue")

    def answer(*images: str) -> str:
        flags = [a for image in images for a in ("--image", image)]
        result = runner.invoke(app, ["run", "demo-vision", "-p", "What is this?", "-n", "8",
                                     "-t", "0", *flags])
        assert result.exit_code == 0, result.output
        return result.stdout

    assert answer(red) == answer(red)
    assert answer(red) != answer(blue)
    assert answer(red, blue) not in (answer(red), answer(blue))  # two images, both read


def test_image_errors_are_one_sentence(tmp_path):
    missing = gmlx("run", "demo-vision", "-p", "x", "--image", str(tmp_path / "no.png"))
    assert missing.returncode == 1 and "Cannot read the image" in missing.stderr
    text = tmp_path / "notes.png"
    text.write_text("not pixels")
    bad = gmlx("run", "demo-vision", "-p", "x", "--image", str(text))
    assert bad.returncode == 1 and "not a readable image" in bad.stderr
    text_only = gmlx("run", "demo", "-p", "x", "--image", _image(tmp_path / "r.png", "red"))
    assert text_only.returncode == 1 and "text-only" in text_only.stderr
    assert "Traceback" not in missing.stderr + bad.stderr + text_only.stderr


def test_chat_attaches_an_image_to_the_next_message(tmp_path):
    red = _image(tmp_path / "red.png", "red")
    with_image = runner.invoke(app, ["run", "demo-vision", "-n", "6", "-t", "0"],
                               input=f"/image {red}\nWhat is this?\n/exit\n")
    plain = runner.invoke(app, ["run", "demo-vision", "-n", "6", "-t", "0"],
                          input="What is this?\n/exit\n")
    one_shot = runner.invoke(app, ["run", "demo-vision", "-p", "What is this?", "-n", "6", "-t", "0",
                                   "--image", red])
    assert "1 image(s) attached" in with_image.output
    assert one_shot.stdout.strip() in with_image.output
    assert one_shot.stdout.strip() not in plain.output
