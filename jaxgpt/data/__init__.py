"""Token data: preparing it (streamed, sharded, resumable), loading it, mixing it.

    readers.py  input files (text, JSON Lines, Parquet) -> a stream of text pieces
    corpus.py   prepare_corpus: pieces -> worker processes -> token shards (python -m jaxgpt.prepare)
    writer.py   shards, the resume state and meta.json, in an order that survives any kill
    loader.py   prepared dirs -> memmapped token streams -> Grain windows -> per-process batches
    mix.py      several prepared dirs with weights (data.mix) as one stream of windows
    integrity.py  token files checked against meta.json (size, sha256, token ids) before use
    bundled.py  the bundled tiny shakespeare and the small in-memory single-file `prepare`
"""

import importlib

# Resolved on first use (PEP 562), so that the tokenizer worker processes, which import this
# package, do not pay for importing Grain.
_WHERE = {"bundled_shakespeare_dir": "bundled", "prepare": "bundled", "prepare_corpus": "corpus",
          "BUNDLED": "loader", "SPLITS": "loader", "ShardedTokens": "loader", "Windows": "loader",
          "eval_batches": "loader", "load_meta": "loader", "load_split": "loader",
          "resolve_data_dir": "loader", "train_iterator": "loader",
          "Mixture": "mix", "describe_sources": "mix", "open_splits": "mix", "parse_mix": "mix",
          "check_dir": "integrity"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxgpt.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxgpt.data.{_WHERE[name]}"), name)
