"""Token sequences -> windows -> this process's batch rows (a split's tokens come from splits.py).

1. Window i is tokens[i*T : i*T + T + 1] (T = seq_len): non-overlapping starts, T+1 tokens so
   inputs/targets are x[:, :-1] / x[:, 1:]. There are (len(tokens) - 1) // T windows. Windows
   run over shard boundaries (and over the `<|endoftext|>` between documents) like any token.
2. `train_iterator` shuffles the window indices (a lazy permutation, never materialised),
   repeats forever (each epoch gets a fresh permutation from the seed and the epoch number) and
   cuts the endless stream into global batches of G consecutive windows. Global batch s is the
   same whatever the process count P is; process p reads only rows p*G/P : (p+1)*G/P of it.
   This is done by batching into local batches of G/P windows and letting process p take local
   batches p, p+P, p+2P, ...: it never reads another process's windows.
   A batch may hold the last windows of one epoch and the first of the next; every window is
   still seen exactly once per epoch.
3. The iterator is grain's, so `get_state()` / `set_state()` resume it exactly (the state is the
   index of the next local batch, the same on every process).
4. A `Mixture` (`data.mix='web:0.7,code:0.3'`, parsed and opened by sources.py) changes only the
   stream of windows. Each component's windows are shuffled with their own seed (derived from
   train.seed and the component's position) and repeated forever, then `grain.MapDataset.mix`
   interleaves them: it is a deterministic function of the index (element k comes from the
   component whose running count first falls behind its share), so the mixed stream is a
   MapDataset like a single split's and everything above holds unchanged: the same global batch
   for any process count, process p reads only its own local batches, and the iterator state (one
   index) resumes exactly. Grain turns the weights into integers (the smallest scaled to 100), so
   shares are exact to about 1%. Evaluation mixes the components' val windows the same way,
   unshuffled.

Fine-tuning (data.chat) changes only the source: a split of conversations
(jaxgpt/data/conversations.py) gives its packed windows, each a pair (tokens [T+1], weights [T]),
which are shuffled, batched and cut per process as windows are; a batch is then the pair
(tokens [B, T+1], weights [B, T]).

`eval_batches` is the unshuffled counterpart for evaluation: batch b holds windows
[b*G, (b+1)*G) modulo the number of windows, cut the same way into per-process rows.
"""

from collections.abc import Sequence

import grain
import numpy as np

from jaxgpt.errors import UserError


class Windows:
    """Grain map source: window i = tokens[i*T : i*T + T + 1] as int32."""

    def __init__(self, tokens, seq_len: int):
        if seq_len < 1:
            raise UserError(f"seq_len must be at least 1, got {seq_len}.")
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n <= 0:
            raise UserError(f"{len(tokens)} tokens are too few for one window of seq_len "
                            f"{seq_len} (needs {seq_len + 1}); use more data or a shorter seq_len.")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range [0, {self.n})")
        start = i * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


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


def _windows(tokens, seq_len: int):
    """A split's windows: a token sequence's (`Windows`) or a conversations split's packed ones."""
    return tokens.windows(seq_len) if hasattr(tokens, "windows") else Windows(tokens, seq_len)


def _local_batch(global_batch: int, process_index: int, process_count: int) -> int:
    if global_batch < 1 or process_count < 1 or global_batch % process_count:
        raise UserError(f"global batch {global_batch} must be a positive multiple of the "
                        f"process count {process_count}.")
    if not 0 <= process_index < process_count:
        raise UserError(f"process_index {process_index} is outside [0, {process_count}).")
    return global_batch // process_count


def train_iterator(tokens, *, seq_len: int, global_batch: int, seed: int, process_index: int,
                   process_count: int, prefetch: int = 2, num_threads: int = 2) -> grain.DatasetIterator:
    """Endless shuffled [global_batch // process_count, seq_len + 1] int32 batches.

    `tokens` is one split's tokens, or a `Mixture` of several.
    """
    local = _local_batch(global_batch, process_index, process_count)
    if isinstance(tokens, Mixture):
        ds = tokens.train_windows(seq_len, seed)
    else:
        ds = (grain.MapDataset.source(_windows(tokens, seq_len))
              .shuffle(seed=seed)  # before repeat: epoch e is permuted with (seed, e)
              .repeat(None))
    ds = (ds.batch(local, drop_remainder=True)  # the stream is endless, so every batch is full
          .slice(slice(process_index, None, process_count)))
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def eval_batches(tokens, *, seq_len: int, global_batch: int, num_batches: int,
                 process_index: int, process_count: int) -> Sequence[np.ndarray]:
    """Fixed unshuffled batches: global batch b = windows [b*G, (b+1)*G) mod #windows. Each batch is
    read when it is asked for (every evaluation), not all at the start: a run's memory check comes
    after this, and a batch too big for the host must fail there, not hang here."""
    local = _local_batch(global_batch, process_index, process_count)
    windows = tokens.eval_windows(seq_len) if isinstance(tokens, Mixture) else _windows(tokens, seq_len)
    return _EvalBatches(windows, global_batch, local, process_index, num_batches)


class _EvalBatches(Sequence):
    def __init__(self, windows, global_batch: int, local: int, process_index: int, num_batches: int):
        self.windows, self.global_batch, self.local = windows, global_batch, local
        self.process_index, self.num_batches = process_index, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, b: int) -> np.ndarray:
        if not 0 <= b < self.num_batches:
            raise IndexError(b)
        ids = (b * self.global_batch + self.process_index * self.local + np.arange(self.local)) % len(self.windows)
        rows = [self.windows[int(i)] for i in ids]
        return tuple(map(np.stack, zip(*rows))) if isinstance(rows[0], tuple) else np.stack(rows)
