"""Mixtures: several prepared directories sampled by weight as one stream of windows.

`data.mix='web:0.7,code:0.3'` names prepared directories (or 'shakespeare') with weights. Each
component's windows are shuffled with their own seed (derived from train.seed and the
component's position) and repeated forever, then `grain.MapDataset.mix` interleaves them: it is a
deterministic function of the index (element k comes from the component whose running count
first falls behind its share), so the mixed stream is a MapDataset like a single split's and
everything loader.py says about it holds unchanged: the same global batch for any process count,
process p reads only its own local batches, and the iterator state (one index) resumes exactly.
Grain turns the weights into integers (the smallest scaled to 100), so shares are exact to about
1%. Evaluation mixes the components' val windows the same way, unshuffled.
"""

from pathlib import Path

import grain
import numpy as np

from jaxgpt.data.integrity import check_dir
from jaxgpt.data.loader import Windows, load_meta, load_split, resolve_data_dir
from jaxgpt.errors import UserError


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


class Mixture:
    """One split of several prepared directories, with their weights."""

    def __init__(self, names: list[str], parts: list, weights: list[float]):
        self.names, self.parts, self.weights = names, parts, weights

    def __len__(self) -> int:  # tokens in all components
        return sum(len(p) for p in self.parts)

    def describe(self) -> str:
        return ",".join(f"{n}:{w:g}" for n, w in zip(self.names, self.weights))

    def train_windows(self, seq_len: int, seed: int) -> grain.MapDataset:
        components = [grain.MapDataset.source(Windows(p, seq_len))
                      .shuffle(seed=int(np.random.SeedSequence([seed, i]).generate_state(1)[0]))
                      .repeat(None)
                      for i, p in enumerate(self.parts)]
        return grain.MapDataset.mix(components, self.weights)

    def eval_windows(self, seq_len: int) -> grain.MapDataset:
        components = [grain.MapDataset.source(Windows(p, seq_len)).repeat(None) for p in self.parts]
        return grain.MapDataset.mix(components, self.weights)


def open_splits(path: str, mix: str = "", cache: Path | None = None):
    """(train, val, vocab_size, description) for data.path, or for data.mix when it is set.

    Every token file is checked against its meta.json first (integrity.py); `cache` (a run dir's
    data-verified.json) remembers the files already checked.
    """
    if not mix:
        data_dir = resolve_data_dir(path)
        check_dir(data_dir, load_meta(data_dir), cache=cache)
        return (load_split(data_dir, "train"), load_split(data_dir, "val"),
                load_meta(data_dir)["vocab_size"], path)
    parsed = parse_mix(mix)
    dirs = [resolve_data_dir(name) for name, _ in parsed]
    for d in dirs:
        check_dir(d, load_meta(d), cache=cache)
    names, weights = [n for n, _ in parsed], [w for _, w in parsed]
    splits = [Mixture(names, [load_split(d, s) for d in dirs], weights) for s in ("train", "val")]
    vocab = max(load_meta(d)["vocab_size"] for d in dirs)
    return splits[0], splits[1], vocab, splits[0].describe()


def describe_sources(path: str, mix: str = "") -> list[dict]:
    """What a run trains on, for events.jsonl and report.md: each directory (resolved) with its
    weight (a mixture only), tokenizer and token and document counts (as its meta.json records)."""
    parsed = parse_mix(mix) if mix else [(path, None)]
    out = []
    for name, weight in parsed:
        d = resolve_data_dir(name)
        meta = load_meta(d)
        docs = [meta.get(f"{s}_documents") for s in ("train", "val")]
        out.append({"name": name, "dir": str(d.absolute()), **({"weight": weight} if mix else {}),
                    "tokenizer": meta.get("tokenizer", "unknown"),
                    "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
                    **({"documents": sum(docs)} if all(isinstance(n, int) for n in docs) else {})})
    return out
