"""What a run reads: data.path or data.mix -> checked prepared directories -> its train and val splits.

`data.path` names one prepared directory, or 'shakespeare' for the bundled corpus (bundled.py,
prepared on first use with the run's tokenizer). Every directory must have been prepared with the
run's tokenizer (data.tokenizer: meta.json's tokenizer_sha256 is its identity, jaxgpt/tokenizer.py),
else the run is refused before compiling. `data.chat` (fine-tuning) replaces them with chat data
(conversations.py): `open_run_data` opens whichever the config names. `data.mix='web:0.7,code:0.3'` names several with weights; their splits
become `loader.Mixture`s (the weighted interleave is described there). Every token file is checked
against its meta.json before use (integrity.py). `describe_sources` is what events.jsonl and
report.md say a run trained on.
"""

from pathlib import Path
from typing import Any, NamedTuple

from jaxgpt import files, tokenizer
from jaxgpt.data.bundled import bundled_shakespeare_dir
from jaxgpt.data.integrity import check_dir
from jaxgpt.data.loader import Mixture
from jaxgpt.data.splits import PREPARE_HINT, SPLITS, load_meta, load_split
from jaxgpt.errors import UserError

BUNDLED = "shakespeare"


def resolve_data_dir(path: str, tok: tokenizer.Tokenizer | None = None) -> Path:
    """"shakespeare" -> the bundled corpus (tokenized by `tok`, default GPT-2's); otherwise a prepared
    directory, checked."""
    if path == BUNDLED:
        return bundled_shakespeare_dir(tok)
    data_dir = Path(path).expanduser()
    if not data_dir.is_dir():
        kind = files.kind(data_dir)
        there = "does not exist" if kind == "missing" else f"is {kind}, not a directory"
        raise UserError(f"Data directory {data_dir} {there}; make it with "
                        f"`{PREPARE_HINT}` or use '{BUNDLED}'.")
    if (data_dir / "meta.json").exists() and "shards" in load_meta(data_dir):
        names = [s["file"] for split in SPLITS for s in load_meta(data_dir)["shards"][split]]
    else:
        names = ["meta.json", "train.bin", "val.bin"]
    missing = [n for n in names if not (data_dir / n).exists()]
    if missing:
        unfinished = " (an unfinished preparation: run the same prepare command to finish it)" \
            if (data_dir / ".prepare-state.json").is_file() else ""
        raise UserError(f"Data directory {data_dir} lacks {', '.join(missing[:3])}"
                        f"{' and more' if len(missing) > 3 else ''}{unfinished}; make it with "
                        f"`{PREPARE_HINT}`.")
    for name in names:
        files.require_file(data_dir / name, "data file")  # not a directory
    load_meta(data_dir)
    return data_dir


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """'web:0.7,code:0.3' -> [('web', 0.7), ('code', 0.3)] (weights normalised to sum to 1)."""
    parts = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, weight = item.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = float("nan")
        if not sep or not name or not w > 0 or w == float("inf"):
            raise UserError(f"data.mix {spec!r}: {item!r} is not DIR:WEIGHT with a positive weight "
                            "(for example data.mix='web:0.7,code:0.3').")
        parts.append((name, w))
    if not parts:
        raise UserError("data.mix is empty; give DIR:WEIGHT pairs such as 'web:0.7,code:0.3'.")
    names = [n for n, _ in parts]
    if len(set(names)) != len(names):
        raise UserError(f"data.mix {spec!r} names a directory twice.")
    total = sum(w for _, w in parts)
    return [(n, w / total) for n, w in parts]


def check_tokenizer(data_dir: Path, tok: tokenizer.Tokenizer) -> None:
    """UserError (one line) unless `data_dir` was prepared with `tok`."""
    meta = load_meta(data_dir)
    if meta["tokenizer_sha256"] != tok.sha256:
        spec = "gpt2" if tok.name == tokenizer.TOKENIZER_NAME else tok.name
        raise UserError(f"{data_dir} was tokenized with another tokenizer ({meta.get('tokenizer', 'unknown')}, "
                        f"{meta.get('vocab_size', '?')} tokens) than this run's data.tokenizer={spec}; prepare it again "
                        f"with `{PREPARE_HINT} --tokenizer {spec}`, or set data.tokenizer to the one it was made with")


def open_splits(path: str, mix: str = "", cache: Path | None = None, tok: tokenizer.Tokenizer | None = None):
    """(train, val, vocab_size, description) for data.path, or for data.mix when it is set.

    Every token file is checked against its meta.json first (integrity.py); `cache` (a run dir's
    data-verified.json) remembers the files already checked. Every directory must have been
    prepared with `tok` (default GPT-2's).
    """
    tok = tok or tokenizer.load(tokenizer.TOKENIZER_NAME)
    if not mix:
        data_dir = resolve_data_dir(path, tok)
        check_tokenizer(data_dir, tok)
        check_dir(data_dir, load_meta(data_dir), cache=cache)
        return (load_split(data_dir, "train"), load_split(data_dir, "val"),
                load_meta(data_dir)["vocab_size"], path)
    parsed = parse_mix(mix)
    dirs = [resolve_data_dir(name, tok) for name, _ in parsed]
    for d in dirs:
        check_tokenizer(d, tok)
        check_dir(d, load_meta(d), cache=cache)
    names, weights = [n for n, _ in parsed], [w for _, w in parsed]
    splits = [Mixture(names, [load_split(d, s) for d in dirs], weights) for s in ("train", "val")]
    vocab = max(load_meta(d)["vocab_size"] for d in dirs)
    return splits[0], splits[1], vocab, splits[0].describe()


def describe_sources(path: str, mix: str = "", chat: str = "", tokenizer_spec: str = "gpt2") -> list[dict]:
    """What a run trains on, for events.jsonl and report.md: each directory (resolved) with its
    weight (a mixture only), tokenizer and token and document counts (as its meta.json records);
    for chat data (data.chat) its files and the tokenizer."""
    tok = tokenizer.load(tokenizer_spec)
    if chat:
        from jaxgpt.data.conversations import input_files
        return [{"name": f"chat data {chat}", "dir": ", ".join(str(p.absolute()) for p in input_files(chat)),
                 "tokenizer": tok.describe()}]
    parsed = parse_mix(mix) if mix else [(path, None)]
    out = []
    for name, weight in parsed:
        d = resolve_data_dir(name, tok)
        meta = load_meta(d)
        docs = [meta.get(f"{s}_documents") for s in ("train", "val")]
        out.append({"name": name, "dir": str(d.absolute()), **({"weight": weight} if mix else {}),
                    "tokenizer": meta.get("tokenizer", "unknown"),
                    "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
                    **({"documents": sum(docs)} if all(isinstance(n, int) for n in docs) else {})})
    return out


class RunData(NamedTuple):
    """What a run trains and evaluates on (`open_run_data`)."""
    train: Any  # a split's tokens, a Mixture, or conversations (fine-tuning)
    val: Any
    vocab_size: int  # the largest id + 1 the data can hold (its tokenizer's vocabulary)
    note: str | None  # a line for the start-up log (fine-tuning's chat data), or None


def open_run_data(cfg, cache: Path | None = None) -> RunData:
    """The run's data, checked before anything compiles: data.chat's conversations (tokenized with
    the run's tokenizer and chat template, packed for model.seq_len) or data.path / data.mix's
    prepared directories (prepared with the run's tokenizer). `cfg`: the run's Config."""
    tok = tokenizer.load(cfg.data.tokenizer)
    if cfg.data.chat:
        from jaxgpt.chat.template import ChatTemplate
        from jaxgpt.data.conversations import open_chat

        d = cfg.data
        chats = open_chat(d.chat, tok, ChatTemplate(tok, d.chat_template), d.chat_val_fraction, d.skip_bad_lines,
                          cfg.model.seq_len)
        return RunData(chats.train, chats.val, tok.n_vocab, chats.note)
    train, val, vocab, _ = open_splits(cfg.data.path, cfg.data.mix, cache, tok)
    return RunData(train, val, vocab, None)
