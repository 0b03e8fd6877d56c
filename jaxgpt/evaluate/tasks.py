"""Multiple-choice task files -> token sequences to score, the way lm-evaluation-harness builds them.

Two local JSON Lines formats, told apart by the first record (every record must then be of that
format; blank lines are skipped):

    HellaSwag   the published hellaswag_{train,val}.jsonl: `ctx_a`, `ctx_b`, `endings` (4 strings),
                `label`, `activity_label` (other keys, e.g. `ctx`, `ind`, are ignored). Preprocessed
                as lm-eval-harness's hellaswag task does (tasks/hellaswag/utils.py): context =
                preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()), each choice
                = preprocess(ending), where preprocess strips, turns " [title]" into ". ", drops
                every "[...]" (WikiHow artefacts) and replaces double spaces with single ones.
    generic     `context` (string), `choices` (non-empty list of non-empty strings), `label`.

`label` is the index of the right choice, an integer or a string of digits (HF's copy of
HellaSwag stores "3"). Each (example, choice) becomes one request, as lm-eval-harness's
multiple_choice output type and its HF model (`_encode_pair`, `loglikelihood`) make it: the
continuation is " " + choice (the default target_delimiter); trailing whitespace of the context
moves to the front of the continuation; context tokens = encode(context), continuation tokens =
encode(context + continuation)[len(context tokens):]; an empty context becomes `<|endoftext|>`.
The scored sequence is (context + continuation)[-(T+1):], the context cut on the left to the
model's T positions; a continuation longer than T tokens is refused. `<|endoftext|>` written in a
text is the special token, as GPT-2's Hugging Face tokenizer reads it.

Every problem with a file is one `UserError` naming the file and line: missing file, not UTF-8,
a line that is not a JSON object, a missing or mistyped field, no choices, an empty choice, a label
out of range, a continuation too long (or with no tokens of its own), and a file with no examples.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxgpt import files
from jaxgpt.errors import UserError
from jaxgpt import tokenizer

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # metric keys task/NAME/acc: no '/', '=' or ','
HELLASWAG = {"ctx_a": str, "ctx_b": str, "endings": list, "label": (int, str), "activity_label": str}
GENERIC = {"context": str, "choices": list, "label": (int, str)}


class Task(NamedTuple):
    """One task's examples as tokens: example e's choice c is the sequence `tokens[e][c]` whose last
    `continuation[e][c]` tokens are scored; `chars[e][c]` is the choice's length in characters."""
    name: str
    path: Path
    tokens: list[list[np.ndarray]]
    continuation: list[list[int]]
    chars: list[list[int]]
    labels: np.ndarray  # [examples]


def parse_spec(spec: str, what: str = "eval.tasks") -> list[tuple[str, Path]]:
    """'NAME=PATH,PATH,...' -> [(name, path)], the names checked (allowed characters, unique). A PATH
    alone is named by its file name without the extension (hellaswag_val.jsonl -> hellaswag_val)."""
    out: list[tuple[str, Path]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, path = part.partition("=")
        name, path = name.strip(), path.strip()
        if not sep:
            name, path = Path(name).stem, name
            if not NAME.match(name):
                raise UserError(f"{what}: the file name of '{part}' cannot name a task (letters, digits, '_', "
                                f"'.' and '-'); give NAME=PATH")
        if not name or not path:
            raise UserError(f"{what}: '{part}' is not of the form NAME=PATH or PATH")
        if not NAME.match(name):
            raise UserError(f"{what}: task name '{name}' may hold only letters, digits, '_', '.' and '-' "
                            f"(in '{part}'; the form is NAME=PATH or PATH)")
        if name in (n for n, _ in out):
            raise UserError(f"{what}: task name '{name}' is given twice; name each task (NAME=PATH)")
        out.append((name, Path(path)))
    return out


def preprocess(text: str) -> str:
    """lm-eval-harness's HellaSwag text cleaning."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _label(value, n: int, where: str) -> int:
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise UserError(f"{where}: 'label' is {value!r:.40}, not an integer")
        value = int(value)
    if not 0 <= value < n:
        raise UserError(f"{where}: label {value} is out of range for {n} choices (0..{n - 1})")
    return value


def _strings(value: list, key: str, where: str) -> list[str]:
    if not value:
        raise UserError(f"{where}: '{key}' is empty; an example needs at least one choice")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise UserError(f"{where}: {key}[{i}] is {type(s).__name__}, not a string")
        if not s.strip():
            raise UserError(f"{where}: {key}[{i}] is empty (it has no length to normalise by)")
    return value


def read_examples(path: Path, limit: int = 0) -> list[tuple[str, list[str], int]]:
    """(context, choices, label) of each example in a task file (the first `limit`; 0 = all)."""
    return [(context, choices, label) for _, context, choices, label in _numbered_examples(path, limit)]


def _numbered_examples(path: Path, limit: int = 0) -> list[tuple[int, str, list[str], int]]:
    """(line number, context, choices, label) of each example: the number (from 1, blank lines
    counted) names the line in the errors found once the example is tokenized (load_task)."""
    text = files.read_text(path, "task file").removeprefix("\ufeff")  # a BOM (Windows editors), as prepare drops it
    examples, fmt = [], None
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"task file {path}: line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} is not valid JSON ({e.msg}): {line.strip()!r:.60}") from None
        if fmt is None:
            fmt = HELLASWAG if isinstance(record, dict) and "endings" in record else GENERIC
        files.check_shape(record, where, required=fmt)
        if fmt is HELLASWAG:
            endings = _strings(record["endings"], "endings", where)
            ctx = record["ctx_a"] + " " + record["ctx_b"].capitalize()
            context, choices = preprocess(record["activity_label"] + ": " + ctx), [preprocess(e) for e in endings]
        else:
            context, choices = record["context"], _strings(record["choices"], "choices", where)
        examples.append((number, context, choices, _label(record["label"], len(choices), where)))
        if limit and len(examples) == limit:
            break
    if not examples:
        raise UserError(f"task file {path} holds no examples")
    return examples


def encode_pair(context: str, continuation: str, tok: tokenizer.Tokenizer | None = None
                ) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval-harness's HF model `_encode_pair` makes them,
    with `tok` (the run's data.tokenizer; default GPT-2's, whose document separator stands for an
    empty context)."""
    tok = tok or tokenizer.load(tokenizer.TOKENIZER_NAME)
    encode = tok.encode_special
    if not context:
        return [tok.separator_id], encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encode(context)
    return context_ids, encode(context + continuation)[len(context_ids):]


def load_task(name: str, path: Path, seq_len: int, limit: int = 0, tok: tokenizer.Tokenizer | None = None) -> Task:
    """A task file read, checked and tokenized (by `tok`, default GPT-2's) for a model of `seq_len` positions."""
    tokens, continuation, chars, labels = [], [], [], []
    for number, context, choices, label in _numbered_examples(path, limit):
        row_tokens, row_cont = [], []
        for c, choice in enumerate(choices):
            context_ids, cont_ids = encode_pair(context, " " + choice, tok)
            where = f"task file {path}: line {number}: choice {c}"
            if not cont_ids:
                raise UserError(f"{where} has no tokens of its own (the tokenizer merges it into the context's "
                                f"last token)")
            if len(cont_ids) > seq_len:
                raise UserError(f"{where} is {len(cont_ids)} tokens, more than the model's context of {seq_len}")
            row_tokens.append(np.asarray((context_ids + cont_ids)[-(seq_len + 1):], np.int32))
            row_cont.append(len(cont_ids))
        tokens.append(row_tokens)
        continuation.append(row_cont)
        chars.append([len(c) for c in choices])
        labels.append(label)
    return Task(name, Path(path), tokens, continuation, chars, np.asarray(labels))


def load_tasks(spec: str, seq_len: int, limit: int = 0, what: str = "eval.tasks",
               tok: tokenizer.Tokenizer | None = None) -> list[Task]:
    return [load_task(name, path, seq_len, limit, tok) for name, path in parse_spec(spec, what)]
