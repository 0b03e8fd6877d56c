"""The GPT-2 byte-pair tokenizer, built offline from the vocabulary shipped in the package.

`tiktoken.get_encoding("gpt2")` would download its vocabulary on first use; a training job must
not depend on the network, so we build the same `tiktoken.Encoding` from
`assets/r50k_base.tiktoken` (r50k_base and gpt2 share ranks, split pattern and `<|endoftext|>`).
`load_tiktoken_bpe` checks the file against its known sha256, so a damaged asset fails loudly
instead of silently tokenizing differently. (For a local path it reads the file directly; it may
keep a copy in tiktoken's own cache directory, but it never opens a connection.)

The vocabulary hash is also written into every prepared dataset's meta.json, so data tokenized
with another vocabulary is refused at load time rather than trained on.
"""

import functools
import hashlib
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load

from jaxgpt.errors import UserError

TOKENIZER_NAME = "gpt2"
EOT_ID = 50256
EOT_TEXT = "<|endoftext|>"  # its text: GPT-2's bos, eos and document separator
N_VOCAB = 50257

_VOCAB_PATH = Path(__file__).parent / "assets" / "r50k_base.tiktoken"
_VOCAB_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# Copied from tiktoken_ext/openai_public.py (r50k_pat_str, used by both "gpt2" and "r50k_base").
# The possessive quantifiers are tiktoken's faster spelling of the original GPT-2 pattern; both
# split text identically.
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@functools.cache
def mergeable_ranks() -> dict[bytes, int]:
    """Token bytes -> rank (its id) of the packaged vocabulary, checked against its sha256."""
    return tiktoken.load.load_tiktoken_bpe(str(_VOCAB_PATH), expected_hash=_VOCAB_SHA256)


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding; `encode_ordinary` treats "<|endoftext|>" in text as plain text."""
    return tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=_PAT_STR,
        mergeable_ranks=mergeable_ranks(),
        special_tokens={EOT_TEXT: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )


@functools.cache
def vocab_sha256() -> str:
    """sha256 of the packaged vocabulary file: the tokenizer's identity in meta.json."""
    return hashlib.sha256(_VOCAB_PATH.read_bytes()).hexdigest()


@functools.cache
def token_bytes(size: int = N_VOCAB) -> np.ndarray:
    """int32 [size]: the UTF-8 bytes each token id decodes to, 0 for `<|endoftext|>` (a document
    boundary, not text) and for ids past the vocabulary (the model's padding). GPT-2's tokens are
    byte strings, so the bytes of a token sequence's text are the sum over its tokens, exactly."""
    table = np.zeros(size, np.int32)
    for token, rank in mergeable_ranks().items():
        if rank < size:
            table[rank] = len(token)
    return table


def check_ids_fit(largest_id: int, vocab_size: int, what: str) -> None:
    """UserError if GPT-2 token ids up to `largest_id` do not fit a model of `vocab_size` tokens (an
    imported model with its own, smaller vocabulary): its embedding lookup would clamp them silently."""
    if largest_id >= vocab_size:
        raise UserError(f"{what} holds GPT-2 token id {largest_id}, past this model's vocabulary of {vocab_size} "
                        f"tokens (model.vocab_size): jaxgpt tokenizes with GPT-2's {N_VOCAB}-token BPE, which this "
                        f"model was not made for")
