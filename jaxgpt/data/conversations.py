"""Chat data for supervised fine-tuning (data.chat): conversations -> tokens and a loss mask -> packed windows.

Input. JSON Lines (.jsonl, .ndjson, .json, also .gz/.zst) or Parquet files, directories or globs
(comma-separated in data.chat), one conversation per line or row in a `messages` field or column:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

or `data.chat=bundled`, the generated chat set of jaxgpt/chat/bundled.py. Each conversation is
checked and rendered by the chat template (jaxgpt/chat/template.py): its tokens, the document
separator first, and a mask that is 1 on the assistant's tokens (content and end-of-turn marker).

Bad input. A line that is not JSON, a record without `messages`, a message without a role or
content, a role the template does not render, a conversation with no assistant turn: one error
naming the file and line, or with data.skip_bad_lines=true skipped and counted in the start line.

Split. Conversation i (counting the good ones from 0) is held out for the val loss when
floor((i + 1) f) > floor(i f), f = data.chat_val_fraction: every 1/f-th, as prepare splits documents.

Windows. Each split's conversations are packed in order into windows of seq_len + 1 tokens:
a window takes conversations while they fit whole, then is padded (weight 0) with one separator
and then id 0: the padding is one document of its own that nothing reads. model.document_mask (required with data.chat) keeps every
conversation from seeing another, and with model.position_reset each starts at position 0, so a
packed conversation is scored as it would be alone (tests/test_sft.py). A conversation longer than
the window is truncated to its first seq_len + 1 tokens (counted in the start line); one left with
no assistant token in them is dropped (counted too). Window w yields (tokens [T+1] int32, weights
[T] float32), weights[t] = mask[t+1]: the weight of predicting token t+1. The loader
(jaxgpt/data/loader.py) shuffles and batches windows as it does pretraining windows, so a resumed
run continues the same sequence of batches.

Tokenizing is done once: the result is cached in the jaxgpt cache directory under the sha256 of the
inputs, the tokenizer, the template and these options, so a resumed run starts without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxgpt import files
from jaxgpt.chat.template import BadConversation, ChatTemplate
from jaxgpt.data import readers
from jaxgpt.errors import UserError
from jaxgpt.tokenizer import Tokenizer

FORMAT = 1
FIELD = "messages"
BUNDLED = "bundled"


class Conversations:
    """One split's conversations end to end: tokens, loss mask and where each one starts."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray, separator_id: int):
        self.tokens, self.mask, self.starts, self.separator_id = tokens, mask, starts, separator_id
        self._windows: dict[int, PackedWindows] = {}

    def __len__(self) -> int:  # tokens, as a prepared split's length
        return len(self.tokens)

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.tokens[a:b], self.mask[a:b]

    def windows(self, seq_len: int) -> PackedWindows:
        if seq_len not in self._windows:
            self._windows[seq_len] = PackedWindows(self, seq_len)
        return self._windows[seq_len]


class PackedWindows:
    """Grain map source: window w = (tokens [T+1] int32, weights [T] float32) (module docstring)."""

    def __init__(self, convs: Conversations, seq_len: int):
        self.convs, self.T1 = convs, seq_len + 1
        lengths = np.diff(convs.starts)
        self.truncated = int(np.sum(lengths > self.T1))
        keep = [i for i in range(convs.count) if convs.conversation(i)[1][1:self.T1].any()]
        self.dropped = convs.count - len(keep)
        self.groups: list[list[int]] = []
        used = self.T1
        for i in keep:
            n = min(int(lengths[i]), self.T1)
            if used + n > self.T1:
                self.groups.append([])
                used = 0
            self.groups[-1].append(i)
            used += n
        if not self.groups:
            raise UserError(f"no conversation of the split keeps an assistant token within a window of "
                            f"{self.T1} tokens (model.seq_len + 1); raise model.seq_len or shorten them")
        self.padding = len(self.groups) * self.T1 - sum(min(int(lengths[i]), self.T1) for i in keep)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= w < len(self.groups):
            raise IndexError(f"window {w} out of range [0, {len(self.groups)})")
        tokens = np.zeros(self.T1, np.int32)
        mask = np.zeros(self.T1, np.float32)
        at = 0
        for i in self.groups[w]:
            ids, m = self.convs.conversation(i)
            n = min(len(ids), self.T1)
            tokens[at:at + n], mask[at:at + n] = ids[:n], m[:n]
            at += n
        if at < self.T1:
            tokens[at] = self.convs.separator_id  # the padding: one document, after the last conversation
        return tokens, mask[1:]


class ChatData(NamedTuple):
    train: Conversations
    val: Conversations
    note: str  # what the start line says about them


def input_files(spec: str) -> list[Path]:
    """data.chat -> its files (a generated set for 'bundled'), each JSON Lines or Parquet."""
    if spec.strip() == BUNDLED:
        from jaxgpt.chat.bundled import bundled_chats
        return [bundled_chats()]
    found = readers.find_inputs([p.strip() for p in spec.split(",") if p.strip()] or [spec])
    for path in found:
        if readers.kind(path) == "text":
            raise UserError(f"data.chat: {path} is neither JSON Lines (.jsonl, .ndjson, .json) nor Parquet; chat data "
                            f"is one {{\"{FIELD}\": [...]}} conversation per line or row")
    return found


def open_chat(spec: str, tok: Tokenizer, template: ChatTemplate, val_fraction: float, skip_bad: bool,
              seq_len: int) -> ChatData:
    """data.chat read, checked, tokenized (or taken from the cache), split and packed for seq_len."""
    paths = input_files(spec)
    digest = hashlib.sha256(json.dumps({
        "format": FORMAT, "tokenizer": tok.sha256, "template": template.text, "val_fraction": val_fraction,
        "skip_bad": skip_bad, "inputs": [_sha256(p) for p in paths]}).encode()).hexdigest()
    cache = files.cache_dir() / f"chat-{digest[:24]}.npz"
    loaded = _read_cache(cache)
    if loaded is None:
        loaded = _encode(paths, template, val_fraction, skip_bad)
        _write_cache(cache, loaded)
    tokens, mask, starts, is_val, bad = loaded
    splits = []
    for val in (False, True):
        chosen = np.flatnonzero(is_val == val)
        if not len(chosen):
            raise UserError(f"data.chat {spec}: {len(is_val)} conversation(s) with data.chat_val_fraction="
                            f"{val_fraction} leave the {'val' if val else 'train'} split empty; add conversations "
                            f"or change data.chat_val_fraction")
        pieces = [slice(starts[i], starts[i + 1]) for i in chosen]
        lengths = np.asarray([s.stop - s.start for s in pieces])
        splits.append(Conversations(np.concatenate([tokens[s] for s in pieces]),
                                    np.concatenate([mask[s] for s in pieces]),
                                    np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), tok.separator_id))
    train, val = splits
    for split in splits:
        split.windows(seq_len)  # packed now: a split with nothing to learn within a window is refused here
    tw = train.windows(seq_len)
    cut = sum(s.windows(seq_len).truncated for s in splits)
    dropped = sum(s.windows(seq_len).dropped for s in splits)
    note = (f"chat data {spec}: {train.count + val.count:,} conversations ({train.count:,} train, {val.count:,} val), "
            f"{len(train) + len(val):,} tokens, {mask.mean():.0%} of them assistant's (in the loss); template "
            f"{template.origin}; {len(tw):,} train windows of {seq_len + 1} tokens, {tw.padding / (len(tw) * tw.T1):.0%}"
            f" padding" + (f"; {bad:,} bad conversations skipped (data.skip_bad_lines)" if bad else "")
            + (f"; {cut:,} longer than a window truncated to its first {seq_len + 1} tokens" if cut else "")
            + (f", {dropped:,} of them dropped (no assistant token left)" if dropped else ""))
    return ChatData(train, val, note)


def _sha256(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        return path.stat().st_size, hashlib.file_digest(f, "sha256").hexdigest()


def _encode(paths: list[Path], template: ChatTemplate, val_fraction: float, skip_bad: bool):
    """(tokens, mask, starts, is_val, bad conversations skipped) of every conversation in `paths`."""
    reader = readers.Reader(paths, skip_bad_lines=skip_bad)
    reader.skip_hint = "set data.skip_bad_lines=true"
    ids_list, mask_list, bad = [], [], 0
    for path in paths:
        if readers.kind(path) == "parquet":
            records = reader.column(path, FIELD, _is_list, "lists of messages", f"chat data holds a '{FIELD}' column")
            unit = "row"
        else:
            records, unit = reader.objects(path), "line"
        for number, record in records:
            try:
                if unit == "line":
                    if not isinstance(record, dict) or FIELD not in record:
                        found = ", ".join(map(str, record)) if isinstance(record, dict) else files.json_kind(record)
                        raise BadConversation(f"no {FIELD!r} field (found: {found or 'none'})")
                    record = record[FIELD]
                if record is None:
                    raise BadConversation(f"its {FIELD!r} are null")
                messages = record
                ids, mask = template.encode(template.check(messages))
            except BadConversation as e:
                if not skip_bad:
                    where = f"{path}:{number}" if unit == "line" else f"{path}: row {number}"
                    raise UserError(f"{where}: {e}; fix it or set data.skip_bad_lines=true to skip such "
                                    f"conversations") from None
                bad += 1
                continue
            ids_list.append(ids)
            mask_list.append(mask)
    bad += reader.bad_lines
    if not ids_list:
        raise UserError(f"data.chat holds no conversation to train on ({bad:,} bad ones skipped)"
                        if bad else "data.chat holds no conversations")
    n = len(ids_list)
    is_val = np.asarray([math.floor((i + 1) * val_fraction) > math.floor(i * val_fraction) for i in range(n)])
    starts = np.concatenate([[0], np.cumsum([len(x) for x in ids_list])]).astype(np.int64)
    return np.concatenate(ids_list), np.concatenate(mask_list), starts, is_val, bad


def _is_list(arrow_type) -> bool:
    import pyarrow as pa
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _read_cache(path: Path):
    try:
        with np.load(path) as z:
            return z["tokens"], z["mask"], z["starts"], z["is_val"], int(z["bad"])
    except (OSError, KeyError, ValueError):
        return None  # absent or damaged: tokenize again


def _write_cache(path: Path, loaded) -> None:
    tokens, mask, starts, is_val, bad = loaded
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, tokens=tokens, mask=mask, starts=starts, is_val=is_val, bad=np.asarray(bad))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache is only a shortcut
