"""Issue 61 items 3 and 5, the data side: chat templates rendered as transformers renders them (ids equal
`apply_chat_template`'s, the assistant mask equal its `return_assistant_tokens_mask` on a template that
marks generation), conversations from JSON Lines and Parquet packed into windows, and bad input: one
line naming the file and line, or skipped and counted."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import QWEN_TEMPLATE, qwen_tokenizer, tiny_config

from jaxgpt import data, tokenizer
from jaxgpt.chat.bundled import conversations as bundled_conversations
from jaxgpt.chat.template import BadConversation, ChatTemplate
from jaxgpt.config import validate
from jaxgpt.errors import UserError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."}, {"role": "user", "content": "And héllo in 日本語?"},
        {"role": "assistant", "content": "こんにちは 🤖"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen") / "tok")


def test_ids_and_assistant_mask_equal_apply_chat_templates(qwen):
    from transformers import AutoTokenizer

    tok, auto = tokenizer.load(str(qwen)), AutoTokenizer.from_pretrained(qwen)
    template = ChatTemplate(tok)
    ids, mask = template.encode(template.check(CHAT))
    assert ids[0] == tok.separator_id  # ChatML renders no separator: it goes in front, outside the loss
    theirs = auto.apply_chat_template(CHAT, tokenize=True, return_dict=True, enable_thinking=False)["input_ids"]
    assert ids[1:].tolist() == list(theirs)
    # the same template with transformers' {% generation %} markers: its assistant mask is ours
    marked = QWEN_TEMPLATE.replace("'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + "
                                   "'<|im_end|>\\n'", "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
                                   "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n'")
    marked = marked.replace("{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
                            "{{- '<|im_start|>' + message.role + '\\n' }}{% if message.role == 'assistant' %}"
                            "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{% else %}"
                            "{{- message.content + '<|im_end|>' }}{% endif %}{{- '\\n' }}")
    assert "generation" in marked
    out = auto.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                   chat_template=marked)
    assert list(out["input_ids"]) == ids[1:].tolist()
    assert list(out["assistant_masks"]) == mask[1:].tolist() and 0 < mask.sum() < len(mask) / 2
    assert tok.decode(ids[mask == 1]) == "2 + 3 = 5.<|im_end|>こんにちは 🤖<|im_end|>"
    # the generation prompt: what a reply is sampled after (with the empty think block, as trained)
    prompt = template.prompt(CHAT[:2], 100)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and prompt[0] == 384
    assert template.end_of_turn == "<|im_end|>"


def test_builtin_templates_gpt2_chatml_and_llama3():
    gpt2 = ChatTemplate(tokenizer.load("gpt2"))
    ids, mask = gpt2.encode(gpt2.check(CHAT[:3]))
    text = tokenizer.load("gpt2").decode(ids)
    assert text == ("<|endoftext|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n")
    assert tokenizer.load("gpt2").decode(ids[mask == 1]) == "2 + 3 = 5.<|im_end|>"  # markers are text here
    assert gpt2.origin == "the built-in ChatML one" and gpt2.end_of_turn == "<|im_end|>"


def _jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_conversations_pack_into_windows_from_jsonl_and_parquet(qwen, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = tokenizer.load(str(qwen))
    template = ChatTemplate(tok)
    chats = [c for c in bundled_conversations(40, seed=1)]
    spec = _jsonl(tmp_path / "chats.jsonl", chats)
    pq.write_table(pa.table({"messages": [c["messages"] for c in chats]}), tmp_path / "chats.parquet")
    a = data.open_chat(spec, tok, template, 0.25, False, seq_len=256)
    b = data.open_chat(str(tmp_path / "chats.parquet"), tok, template, 0.25, False, seq_len=256)
    assert (a.train.count, a.val.count) == (30, 10)  # every 4th conversation held out
    np.testing.assert_array_equal(a.train.tokens, b.train.tokens)
    windows = a.train.windows(256)
    seen = []
    for w in range(len(windows)):
        tokens, weights = windows[w]
        assert tokens.shape == (257,) and weights.shape == (256,) and tokens.dtype == np.int32
        starts = np.flatnonzero(tokens == tok.separator_id)
        assert starts[0] == 0  # every window begins a conversation
        seen.extend(np.split(tokens, starts[1:]))
    for i in range(a.train.count):  # every conversation whole in some window, its mask as the template's
        ids, mask = template.encode(template.check(chats[[j for j in range(40) if (j + 1) // 4 == j // 4][i]]["messages"]))
        assert any(len(piece) >= len(ids) and (piece[:len(ids)] == ids).all() for piece in seen)
    assert "40 conversations (30 train, 10 val)" in a.note


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "hi"}]}, "message 1 has no content"),
    ({"messages": [{"content": "hi"}]}, "message 1 has no role"),
    ({"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "hi"}]},
     "message 1's role 'narrator' is not one the chat template"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "it has no assistant turn (nothing to learn from)"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 1's content is an integer, not a string"),
    ({"messages": "hello"}, "'messages' is a string, not a non-empty list of messages"),
    ({"text": "hello"}, "no 'messages' field (found: text)"),
    ("{not json", "not valid JSON"),
])
def test_bad_conversations_are_one_line_or_skipped_and_counted(qwen, tmp_path, record, message):
    tok = tokenizer.load(str(qwen))
    template = ChatTemplate(tok)
    good = {"messages": CHAT}
    spec = _jsonl(tmp_path / "chats.jsonl", [good, good, record, good])
    with pytest.raises(UserError) as e:
        data.open_chat(spec, tok, template, 0.5, False, seq_len=128)
    assert str(e.value).startswith(f"{spec}:3: {message}") and "\n" not in str(e.value), str(e.value)
    assert "data.skip_bad_lines=true" in str(e.value)
    note = data.open_chat(spec, tok, template, 0.5, True, seq_len=128).note
    assert "3 conversations (2 train, 1 val)" in note and "1 bad conversations skipped" in note


def test_long_conversations_are_truncated_and_counted(qwen, tmp_path):
    tok = tokenizer.load(str(qwen))
    template = ChatTemplate(tok)
    short = {"messages": CHAT[1:3]}
    long_answer = {"messages": [CHAT[1], {"role": "assistant", "content": "five " * 200}]}
    long_question = {"messages": [{"role": "user", "content": "why? " * 200}, CHAT[2]]}
    spec = _jsonl(tmp_path / "chats.jsonl", [short, long_answer, long_question, short])
    chats = data.open_chat(spec, tok, template, 0.25, False, seq_len=64)
    # the long answer keeps its first 65 tokens (answer included); the long question's answer is cut off: dropped
    assert "2 longer than a window truncated to its first 65 tokens, 1 of them dropped (no assistant token left)" \
        in chats.note
    windows = chats.train.windows(64)
    assert len(windows) == 2 and windows[1][1].sum() > 0  # short + short in one, the truncated answer in another


def test_the_template_writing_the_separator_inside_a_conversation_is_refused(qwen, tmp_path):
    tok = tokenizer.load(str(qwen))
    bad = tmp_path / "t.jinja"
    bad.write_text("{% for m in messages %}<|endoftext|>{{ m.content }}{% endfor %}")
    template = ChatTemplate(tok, str(bad))
    with pytest.raises(BadConversation, match="renders the document separator '<\\|endoftext\\|>' inside"):
        template.encode(template.check([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(UserError, match="the chat template is not valid Jinja"):
        ChatTemplate(tok, str(tmp_path / "broken.jinja"))


@pytest.mark.parametrize("overrides, message", [
    (("data.chat=x.jsonl",), "set model.document_mask=true"),
    (("data.chat=x.jsonl", "data.mix=a:1", "model.document_mask=true"), "data.chat and data.mix are both set"),
    (("data.chat=x.jsonl", "model.document_mask=true", "checkpoint.init_from=r"), "set checkpoint.init_params_only=true"),
    (("data.chat_val_fraction=1",), "data.chat_val_fraction must be in (0, 1)"),
])
def test_impossible_chat_configs_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(tiny_config(*overrides), 8)
