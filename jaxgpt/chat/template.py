"""A chat template: messages -> the text a model reads, its tokens, and which of them are the assistant's.

Which template. `data.chat_template` empty takes the tokenizer's own (`chat_template` in the
tokenizer_config.json beside its tokenizer.json, or chat_template.jinja): Qwen's, Llama 3's, any
model's. A tokenizer without one gets a built-in template: Llama 3's format for a tiktoken BPE file
(Llama 3's tokenizer.model), ChatML for the rest, GPT-2's included:

    <|im_start|>user\\nWhat is 2 + 3?<|im_end|>\\n<|im_start|>assistant\\n2 + 3 = 5.<|im_end|>\\n

(GPT-2's vocabulary has no such special tokens: there the markers are ordinary text, a few tokens
each.) `data.chat_template=FILE` reads a Jinja template from a file instead.

Rendering is transformers' `apply_chat_template`'s: Jinja2's sandboxed environment with trim_blocks
and lstrip_blocks, loop controls, `raise_exception`, a `tojson` that does not escape HTML,
`strftime_now`, and bos_token / eos_token from the tokenizer's config; `enable_thinking=False` is
passed too (Qwen3's templates then write the empty <think></think> block of their non-thinking
mode both when training and when prompting). The rendered text is tokenized as a whole with
special tokens parsed, as transformers tokenizes it, so the ids are AutoTokenizer's
(tests/test_chat.py).

The loss mask. Most templates (Qwen's and Llama's among them) do not mark the assistant's text
(transformers' `{% generation %}` blocks), so it is found by rendering: the conversation is
rendered a second time with one assistant message's content replaced by a sentinel character, and
the text where the two renderings differ is that content, wherever the template put it. The span
then takes in the end-of-turn marker after it (Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`: the
first special token a probe conversation renders after an assistant message), so the model learns
to end its turn; sampling stops there. A token counts in the loss when its text overlaps a span;
everything else (system and user turns, the template's headers, the assistant's header) has weight 0.

Conversations are packed into windows (jaxgpt/data/conversations.py), each beginning with the
tokenizer's document separator, which model.document_mask starts a new document at: a template
that renders it first (Llama 3's <|begin_of_text|>) keeps it, one that does not (ChatML) gets it in
front. A template that renders the separator anywhere else inside a conversation is refused: masking
would cut the conversation there.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxgpt import files
from jaxgpt.errors import UserError
from jaxgpt.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ROLES = ("system", "user", "assistant")
_SENTINEL = "\ue000"  # a private-use character: no template adds it and no real message holds it


@functools.cache
def _compile(source: str):
    """The template compiled as transformers compiles it (module docstring)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (its assistant-mask markers): the body
        as it is; the mask is found by rendering (module docstring) whether a template marks it or not."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the chat template is not valid Jinja: {str(e).splitlines()[0]}") from None


class BadConversation(Exception):
    """Why one conversation cannot be trained on (the caller names where it is)."""


class ChatTemplate:
    """The template of a tokenizer (or `source`, a Jinja file), and what it renders."""

    def __init__(self, tok: Tokenizer, source: str = ""):
        self.tok = tok
        if source:
            self.text, self.origin = files.read_text(Path(source).expanduser(), "chat template"), source
        elif tok.chat_template:
            self.text, self.origin = tok.chat_template, f"{tok.name}'s own"
        elif {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"} <= tok.specials.keys():
            self.text, self.origin = LLAMA3, "the built-in Llama 3 one"
        else:
            self.text, self.origin = CHATML, "the built-in ChatML one"
        self.compiled = _compile(self.text)
        self.kwargs = {"bos_token": tok.bos or "", "eos_token": tok.eos or "", "enable_thinking": False}
        self._roles: dict[str, bool] = {}
        probe = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}])
        after = probe[probe.index(_SENTINEL) + 1:] if _SENTINEL in probe else ""
        found = [(after.find(s), s) for s in tok.specials if s in after]
        line = after.strip().split("\n", 1)[0].strip()
        # the end of an assistant turn: the first special token after its content, else (markers that are
        # ordinary text, ChatML with GPT-2's vocabulary) the rest of that line
        self.end_of_turn = min(found)[1] if found else (line or None)

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.kwargs)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text; BadConversation if the template refuses it."""
        import jinja2

        try:
            return self._render(messages, add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise BadConversation(f"the chat template refused it ({str(e).splitlines()[0][:200]})") from None
        except Exception as e:  # noqa: BLE001 - a template is a program: any error of its is this conversation's
            raise BadConversation(f"the chat template failed on it ({type(e).__name__}: {str(e)[:200]})") from None

    def knows(self, role: str) -> bool:
        """Whether the template renders a message of this role: probes, once per role, with the role
        first, after a user turn, after an exchange and after a system message (a template that
        insists on alternating turns refuses some of them)."""
        if role not in self._roles:
            probe, user, reply = ({"role": role, "content": _SENTINEL}, {"role": "user", "content": "x"},
                                  {"role": "assistant", "content": "y"})
            self._roles[role] = False
            for messages in ([probe], [probe, reply], [user, probe], [user, reply, probe],
                             [{"role": "system", "content": "z"}, probe]):
                try:
                    if _SENTINEL in self._render(messages):
                        self._roles[role] = True
                        break
                except Exception:  # noqa: BLE001 - raise_exception on an unknown role, or any template error
                    continue
        return self._roles[role]

    def check(self, messages, need_assistant: bool = True) -> list[dict]:
        """The messages as plain {role, content} dicts; BadConversation saying what is wrong."""
        if not isinstance(messages, list) or not messages:
            raise BadConversation(f"'messages' is {files.json_kind(messages)}, not a non-empty list of messages")
        out = []
        for i, m in enumerate(messages, 1):
            if not isinstance(m, dict):
                raise BadConversation(f"message {i} is {files.json_kind(m)}, not an object with a role and content")
            for key in ("role", "content"):
                if m.get(key) is None:
                    raise BadConversation(f"message {i} has no {key}")
                if not isinstance(m[key], str):
                    raise BadConversation(f"message {i}'s {key} is {files.json_kind(m[key])}, not a string")
                if not files.is_unicode(m[key]):
                    raise BadConversation(f"message {i}'s {key} holds a lone surrogate escape, not Unicode text")
            if not self.knows(m["role"]):
                known = ", ".join(r for r in (*ROLES, "tool") if self.knows(r))
                raise BadConversation(f"message {i}'s role {m['role']!r} is not one the chat template ({self.origin}) "
                                      f"renders ({known})")
            out.append({"role": m["role"], "content": m["content"]})
        if need_assistant and not any(m["role"] == "assistant" for m in out):
            raise BadConversation("it has no assistant turn (nothing to learn from)")
        return out

    def spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """[start, end) of each assistant message's content and end-of-turn marker in `text` (module docstring)."""
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            alt = self.render([*messages[:i], {**m, "content": _SENTINEL}, *messages[i + 1:]])
            a = _common_prefix(text, alt)
            b = len(text) - _common_prefix(text[a:][::-1], alt[a:][::-1])
            if self.end_of_turn and text.startswith(self.end_of_turn, b):
                b += len(self.end_of_turn)
            out.append((a, b))
        return out

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32, loss mask uint8: 1 on the assistant's tokens) of a checked conversation,
        the document separator first."""
        text = self.render(messages)
        spans = self.spans(messages, text)
        ids, offsets = self.tok.encode_with_offsets(text)
        starts, ends = np.asarray(offsets, np.int64).reshape(-1, 2).T
        mask = np.zeros(len(ids), np.uint8)
        for a, b in spans:
            mask[(starts < b) & (ends > a)] = 1
        sep = self.tok.separator_id
        if not ids or ids[0] != sep:
            ids, mask = [sep, *ids], np.concatenate([[0], mask]).astype(np.uint8)
        if sep in ids[1:]:
            raise BadConversation(f"the chat template ({self.origin}) renders the document separator "
                                  f"{self.tok.separator!r} inside the conversation, where document masking "
                                  f"would cut it in two")
        return np.asarray(ids, np.int32), mask

    def prompt(self, messages: list[dict], limit: int) -> list[int]:
        """Ids of the conversation so far and the assistant's header (the separator first), at most
        `limit` of them: the oldest turns after any system message are dropped until it fits."""
        kept = list(messages)
        while True:
            ids = self.tok.encode_special(self.render(kept, add_generation_prompt=True))
            if not ids or ids[0] != self.tok.separator_id:
                ids = [self.tok.separator_id, *ids]
            if len(ids) <= limit:
                return ids
            first = 1 if kept and kept[0]["role"] == "system" else 0
            if len(kept) - first <= 1:
                raise UserError(f"the message is {len(ids)} tokens with the template, more than the {limit} the "
                                f"model's context leaves for it; write a shorter one")
            kept.pop(first)


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix (a binary search of slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
