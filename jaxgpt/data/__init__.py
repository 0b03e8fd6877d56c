"""Token data: preparing it (streamed, sharded, resumable), loading it, mixing it.

    readers.py  input files (text, JSON Lines, Parquet) -> a stream of text pieces
    writer.py   shards, the resume state and meta.json, in an order that survives any kill
    integrity.py  token files checked against meta.json (size, sha256, token ids) before use
    corpus.py   prepare_corpus: pieces -> worker processes -> token shards (python -m jaxgpt.prepare)
    splits.py   a prepared dir's meta.json, checked; each split's memmapped token files as one sequence
    bundled.py  the bundled tiny shakespeare and the small in-memory single-file `prepare`
    loader.py   token sequences -> Grain windows (one split's, or a weighted Mixture's) -> per-process batches
    conversations.py  data.chat: chat files -> tokens and loss masks (jaxgpt/chat/) -> packed windows
    sources.py  data.path / data.mix -> checked prepared dirs -> a run's train and val splits (or data.chat's)

Each file imports only those listed above it.
"""

import importlib

# Resolved on first use (PEP 562), so that the tokenizer worker processes, which import this
# package, do not pay for importing Grain.
_WHERE = {"bundled_shakespeare_dir": "bundled", "prepare": "bundled", "prepare_corpus": "corpus",
          "SPLITS": "splits", "ShardedTokens": "splits", "load_meta": "splits", "load_split": "splits",
          "Mixture": "loader", "Windows": "loader", "eval_batches": "loader", "train_iterator": "loader",
          "BUNDLED": "sources", "describe_sources": "sources", "open_splits": "sources", "parse_mix": "sources",
          "resolve_data_dir": "sources", "check_dir": "integrity", "open_run_data": "sources",
          "RunData": "sources", "open_chat": "conversations"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxgpt.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxgpt.data.{_WHERE[name]}"), name)
