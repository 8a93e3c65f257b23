"""A system message after the first turn: kept where the template takes it, folded into
a user turn where the template refuses it (``Engine`` retries with
:func:`fold_late_system`; tests/server/test_agent_protocols.py runs both through a server)."""

from __future__ import annotations

import pytest

from gmlx.engine.rendering import fold_late_system

S, U, A = "system", "user", "assistant"


def msgs(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


def test_nothing_to_fold():
    assert fold_late_system(msgs((S, "s"), (U, "u"))) is None
    assert fold_late_system(msgs((U, "u"), (A, "a"))) is None


@pytest.mark.parametrize("turns, folded", [
    # the next user turn takes it, before its own text
    (msgs((S, "s"), (U, "u1"), (S, "x"), (A, "a"), (U, "u2")),
     msgs((S, "s"), (U, "u1"), (A, "a"), (U, "x\n\nu2"))),
    # none follows: the previous one, after its text
    (msgs((U, "u1"), (A, "a"), (S, "x")), msgs((U, "u1\n\nx"), (A, "a"))),
    # only system messages before it: it joins the first
    (msgs((S, "s"), (S, "x"), (U, "u")), msgs((S, "s\n\nx"), (U, "u"))),
    # several that join one turn keep their order, both ways
    (msgs((U, "u1"), (S, "x"), (S, "y"), (U, "u2")), msgs((U, "u1"), (U, "x\n\ny\n\nu2"))),
    (msgs((U, "u1"), (A, "a"), (S, "x"), (S, "y")), msgs((U, "u1\n\nx\n\ny"), (A, "a"))),
    # no user turn at all: it becomes one, in its place
    (msgs((A, "a"), (S, "x")), msgs((A, "a"), (U, "x"))),
])
def test_late_system_messages_fold_into_the_adjacent_user_turn(turns, folded):
    before = [dict(m) for m in turns]
    assert fold_late_system(turns) == folded
    assert turns == before  # the caller's messages are not changed


def test_other_fields_of_the_turn_stay():
    turns = [{"role": "user", "content": "u", "name": "ann"}, {"role": "system", "content": "x"}]
    assert fold_late_system(turns) == [{"role": "user", "content": "u\n\nx", "name": "ann"}]


REFUSING = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{{- '<|im_start|>assistant\\n' }}"
)


def test_a_template_that_refuses_renders_the_folded_conversation(demo_model):
    from gmlx.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(demo_model.source)
    tok.hf.chat_template = REFUSING  # a tokenizer of its own: the demo model's is shared
    turns = msgs((S, "s"), (U, "hi"), (S, "Use tools."), (U, "go"))
    with pytest.raises(Exception, match="System message must be at the beginning"):
        tok.render_chat(turns)
    assert tok.render_chat(fold_late_system(turns)) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>user\nUse tools.\n\ngo<|im_end|>\n<|im_start|>assistant\n")
    # The demo template takes a late system message: nothing to fold there.
    assert "<|im_start|>system\nUse tools.<|im_end|>" in demo_model.tokenizer.render_chat(turns)
