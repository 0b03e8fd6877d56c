"""Scoring multiple-choice tasks: every choice's log-likelihood, batched and sharded over a mesh.

Letters: B rows per batch, L a length bucket (positions), D width, V vocabulary.

One row per (example, choice): the input is its token sequence without the last token, the targets
the sequence without the first, and the mask marks the continuation's targets (the last n of them).
A row's score is the sum over the masked positions of log p(target | everything before it): the
log-likelihood of the continuation given the context, in fp32, from the same chunked head as the
val loss (the model's `token_nats`), so the [B, L, V] logits never exist whole.

Shapes. Rows are padded on the right to a length bucket, the smallest of 16, 32, 64, ... (capped at
the model's T) that holds them; padding sits after the real tokens, where a causal model cannot see
it, and is masked out. Batches are B rows of one bucket (the last one filled with empty rows), so
the scorer compiles once per bucket used (at most log2(T) - 2 programs), never per example; rows
are sorted by bucket and their scores put back in order. The batch axis is split over the mesh's
batch axes (dp, fsdp, ep) as a training batch is, the parameters stay as they are placed (training's
shardings, or `sample.shard_params`), and the scores come back replicated, so every process of a
multi-host run computes the same accuracies. The host prepares batch i+1 while the device scores
batch i (results are pulled one batch late).

Metrics (lm-evaluation-harness's multiple_choice): `acc` is the share of examples whose label has the
highest summed log-likelihood; `acc_norm` divides each choice's log-likelihood by its length in
characters (len(choice), without the leading space) first. Ties go to the first choice, as
np.argmax gives them.
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import ModelConfig
from jaxgpt.evaluate.tasks import Task
from jaxgpt.lowering import compute_dtype
from jaxgpt.parallel.mesh import named

MIN_BUCKET = 16


class Scores(NamedTuple):
    name: str
    acc: float
    acc_norm: float
    loglik: list[np.ndarray]  # per example: each choice's summed log-likelihood (fp32)
    seconds: float

    @property
    def examples(self) -> int:
        return len(self.loglik)

    def fields(self) -> dict[str, float]:
        """The metrics.jsonl fields: task/NAME/acc, task/NAME/acc_norm."""
        return {f"task/{self.name}/acc": self.acc, f"task/{self.name}/acc_norm": self.acc_norm}


def buckets(seq_len: int) -> list[int]:
    """The padded row lengths: powers of two from MIN_BUCKET, and seq_len itself."""
    out = [b for b in (MIN_BUCKET << i for i in range(32)) if b < seq_len]
    return [*out, seq_len]


def bucket_of(length: int, seq_len: int) -> int:
    return next(b for b in buckets(seq_len) if b >= length)


def accuracies(loglik: list[np.ndarray], chars: list[list[int]], labels: np.ndarray) -> tuple[float, float]:
    """(acc, acc_norm) as lm-evaluation-harness computes them (module docstring)."""
    pred = np.asarray([np.argmax(ll) for ll in loglik])
    pred_norm = np.asarray([np.argmax(ll / np.asarray(c, np.float64)) for ll, c in zip(loglik, chars, strict=True)])
    return float(np.mean(pred == labels)), float(np.mean(pred_norm == labels))


class Scorer:
    """Scores tasks with a model on a mesh; one instance keeps its compiled programs (one per bucket)."""

    def __init__(self, graphdef: nnx.GraphDef, model_cfg: ModelConfig, mesh: Mesh, batch_rows: int):
        ways = int(np.prod([mesh.shape[a] for a in ("dp", "fsdp", "ep")]))
        self.rows = -(-batch_rows // ways) * ways  # rows per batch: a multiple of the batch axes' devices
        self.mesh, self.cfg = mesh, model_cfg
        self.batch_sharding = named(mesh, ("batch", None))
        dtype = compute_dtype(model_cfg.dtype, mesh.devices.flat[0].platform)

        def score(params: dict, inputs_BL: jax.Array, targets_BL: jax.Array, mask_BL: jax.Array) -> jax.Array:
            model = nnx.merge(graphdef, params)
            nats_BL = model.token_nats(model(inputs_BL, dtype, features_only=True), targets_BL, dtype)
            return -jnp.sum(jnp.where(mask_BL, nats_BL, 0.0), axis=-1)

        self.step = jax.jit(score, out_shardings=NamedSharding(mesh, P()))

    def _global(self, local_BL: np.ndarray) -> jax.Array:
        """A batch every process holds whole, as one array split over the batch axes."""
        return jax.make_array_from_callback(local_BL.shape, self.batch_sharding, lambda index: local_BL[index])

    def _batches(self, sequences: list[np.ndarray], continuation: list[int]):
        """(row indices, inputs, targets, mask) per batch, rows grouped by bucket (module docstring)."""
        T = self.cfg.seq_len
        by_bucket: dict[int, list[int]] = {}
        for i, seq in enumerate(sequences):
            by_bucket.setdefault(bucket_of(len(seq) - 1, T), []).append(i)
        for L, rows in sorted(by_bucket.items()):
            for start in range(0, len(rows), self.rows):
                chunk = rows[start:start + self.rows]
                inputs, targets = np.zeros((self.rows, L), np.int32), np.zeros((self.rows, L), np.int32)
                mask = np.zeros((self.rows, L), bool)
                for r, i in enumerate(chunk):
                    seq, n = sequences[i], len(sequences[i]) - 1
                    inputs[r, :n], targets[r, :n] = seq[:-1], seq[1:]
                    mask[r, n - continuation[i]:n] = True
                yield chunk, inputs, targets, mask

    def loglik(self, params: dict, sequences: list[np.ndarray], continuation: list[int],
               progress: str | None = None) -> np.ndarray:
        """Summed log-likelihood [rows] of each sequence's last `continuation[i]` tokens."""
        from tqdm import tqdm

        out = np.zeros(len(sequences), np.float32)
        bar = tqdm(total=len(sequences), desc=progress, unit="seq", file=sys.stderr, leave=False,
                   disable=None if progress else True)  # None: only on a terminal
        pending = None

        def collect(pending):
            rows, scores = pending
            out[rows] = np.asarray(scores)[:len(rows)]
            bar.update(len(rows))

        with jax.set_mesh(self.mesh):
            for rows, inputs, targets, mask in self._batches(sequences, continuation):
                scores = self.step(params, self._global(inputs), self._global(targets), self._global(mask))
                if pending is not None:
                    collect(pending)  # the previous batch, while this one runs
                pending = (rows, scores)
            if pending is not None:
                collect(pending)
        bar.close()
        return out

    def score(self, params: dict, task: Task, progress: bool = False) -> Scores:
        started = time.perf_counter()
        sequences = [s for row in task.tokens for s in row]
        flat = self.loglik(params, sequences, [n for row in task.continuation for n in row],
                           progress=task.name if progress else None)
        loglik, at = [], 0
        for row in task.tokens:
            loglik.append(flat[at:at + len(row)])
            at += len(row)
        acc, acc_norm = accuracies(loglik, task.chars, task.labels)
        return Scores(task.name, acc, acc_norm, loglik, time.perf_counter() - started)
