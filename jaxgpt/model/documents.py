"""Document masking (model.document_mask): a token attends only to earlier tokens of its own document.

Letters: B batch, T time (the window), S cache slots, M documents per window on the cuDNN path.

Where the separator belongs. Prepared data packs documents as "doc <|endoftext|> doc <|endoftext|>
...", and a window cuts that stream anywhere. As an *input*, `<|endoftext|>` begins the next
document (it is that document's beginning-of-sequence token, as GPT-2 uses it); as a *label* it
ends the previous one: the last token of a document predicts `<|endoftext|>` from its own document,
and the `<|endoftext|>` predicts the next document's first token from itself alone. A window's
first token begins a document too (the tail of one cut by the window). So, for input position t,

    start[t] = the latest s <= t with tokens[s] == <|endoftext|>, or 0
    query t sees key j  iff  start[t] <= j <= t        (causal, and the same document)

Documents are contiguous, so "same document" is this one interval per query, which is what makes
every kernel cheap: XLA's attention takes it as a boolean mask (it builds [B, H, T, T] scores
anyway); the KV cache keeps one `doc_start` per row; and cuDNN's flash attention takes it as its
packed ("THD") layout, each document a sequence of its own (`packed_segments`), so it never
materialises a [T, T] array. With model.position_reset, rotary positions restart at each
document: a token's position is t - start[t] (`Documents.position_BT`).

cuDNN's packed layout has a static number M of sequences per row (model.max_documents) and keeps
softmax statistics of [B*M, H, T] floats, M times the unmasked kernel's. A window with more than
M documents has its documents from the M-th on attend to each other as one (causally): the XLA
path is exact at any count. The `docs_per_window` metric shows how full the windows are.

What masking did shows in the metrics (`window_stats`): `docs_per_window`, the mean number of
documents a training window holds, and `masked_pairs`, the share of causal (query, key) pairs
that document masking removed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgpt.parallel.context import to_device_order
from jaxgpt.tokenizer import EOT_ID


class Documents(NamedTuple):
    """Where each input position's document starts, [B, T] int32 (absolute positions; the window's
    or, decoding, the cache's), each position's place inside its document, [B, T] int32, and each
    index's absolute position, [T] int32 (pos, pos+1, ...; under context parallelism the device
    order of jaxgpt/parallel/context.py, `reordered`)."""
    start_BT: jax.Array
    position_BT: jax.Array
    at_T: jax.Array


def documents(tokens_BT: jax.Array, pos: jax.Array | int = 0, start_B: jax.Array | None = None,
              separator: int = EOT_ID) -> Documents:
    """The documents of tokens sitting at positions pos, pos+1, ...; `start_B` is where the
    document running into them started (decoding: the cache's `doc_start`; default pos).
    `separator`: the id that begins a document (model.document_token; GPT-2's <|endoftext|>)."""
    T = tokens_BT.shape[1]
    at_T = pos + jnp.arange(T, dtype=jnp.int32)
    carried_B = jnp.full(tokens_BT.shape[:1], pos, jnp.int32) if start_B is None else start_B
    begins_BT = jnp.where(tokens_BT == separator, at_T[None, :], carried_B[:, None])
    start_BT = jax.lax.cummax(begins_BT, axis=1)
    return Documents(start_BT, at_T[None, :] - start_BT, at_T)


def whole_windows(B: int, T: int) -> Documents:
    """Documents of windows that attend causally across their separators (no document masking):
    each index's start is 0, so only `at_T` masks (context parallelism's reordering needs it)."""
    at_T = jnp.arange(T, dtype=jnp.int32)
    return Documents(jnp.zeros((B, T), jnp.int32), jnp.broadcast_to(at_T, (B, T)), at_T)


def reordered(docs: Documents, cp: int) -> Documents:
    """docs in the device order of `cp` devices (jaxgpt/parallel/context.py; 1: as is)."""
    return Documents(to_device_order(docs.start_BT, cp), to_device_order(docs.position_BT, cp),
                     to_device_order(docs.at_T, cp, axis=0))


def visible(docs: Documents, key_pos_S: jax.Array) -> jax.Array:
    """[B, T, S] bool: the query at index t (position at[t]) sees the key at position key_pos[j]
    iff start[t] <= key_pos[j] <= at[t]."""
    key_11S = key_pos_S[None, None, :]
    return (key_11S >= docs.start_BT[:, :, None]) & (key_11S <= docs.at_T[None, :, None])


def window_stats(tokens_BT: jax.Array, separator: int = EOT_ID) -> dict[str, jax.Array]:
    """fp32 means over the rows: `docs_per_window` (documents a window holds, the cut ones
    counted) and `masked_pairs` (of the T(T+1)/2 causal pairs, the share masking removes)."""
    T = tokens_BT.shape[1]
    docs = documents(tokens_BT, separator=separator)
    count_B = jnp.sum(docs.position_BT == 0, axis=1)
    hidden_B = jnp.sum(docs.start_BT, axis=1)  # query t loses keys 0 .. start[t] - 1
    return {"docs_per_window": jnp.mean(count_B.astype(jnp.float32)),
            "masked_pairs": jnp.mean(hidden_B.astype(jnp.float32)) / (T * (T + 1) / 2)}
