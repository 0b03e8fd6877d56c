"""`python -m jaxgpt.prepare INPUT... --out DIR`: text, JSON Lines or Parquet -> token shards.

All the work is `jaxgpt.data.prepare_corpus` (jaxgpt/data/corpus.py); mistakes a user can fix
are one `error: ...` line on stderr and exit code 2, with no traceback. Running the same command
again resumes an interrupted preparation, or does nothing if it finished.
"""

import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxgpt.cli import ArgumentParser, path_arg, run_main
from jaxgpt.data.corpus import DEFAULT_SHARD_TOKENS, default_workers, prepare_corpus
from jaxgpt.errors import UserError


def _prepare(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(
        prog="python -m jaxgpt.prepare",
        description="Tokenize documents (GPT-2's BPE, or --tokenizer) into fixed-size token shards "
                    "(train-00000.bin, ..., val-00000.bin, ...) and meta.json. Inputs: UTF-8 text "
                    "files (one document each, or split by --separator) and JSON Lines (.jsonl, .ndjson, "
                    ".json), both also .gz/.zst, and Parquet, as files, directories or globs.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs")
    parser.add_argument("--out", required=True, type=path_arg, metavar="DIR", help="output directory")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="fraction of the documents (every 1/f-th one) kept for validation "
                             "(default 0.1)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (default), a Hugging Face tokenizer.json (or a directory holding one) or a "
                             "tiktoken BPE file such as Llama 3's tokenizer.model: train with the same data.tokenizer; "
                             "documents are separated by its document separator (GPT-2's <|endoftext|>; jaxgpt/tokenizer.py)")
    parser.add_argument("--text-field", default="text",
                        help="JSON field / Parquet column holding the text (default: text)")
    parser.add_argument("--separator", default=None,
                        help="split text files into documents on this string (Python escapes such "
                             "as \\n are understood, e.g. '\\n\\n'); default: one document per file")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) JSON Lines that are not JSON or lack the text field, "
                             "and Parquet rows whose text is null")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"tokenizer processes (default: all cores, here {default_workers()})")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--batch-mb", type=float, default=8.0,
                        help="MB of text read, encoded and committed at a time (default 8)")
    parser.add_argument("--progress", default="auto", choices=("auto", "bar", "lines"),
                        help="a progress bar on a terminal, else periodic lines (auto)")
    args = parser.parse_args(argv)
    if not 0 < args.batch_mb < 1e6:  # also refuses nan and inf
        raise UserError(f"--batch-mb must be in (0, 1e6), got {args.batch_mb}.")
    separator = args.separator
    if separator is not None:
        separator = separator.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        prepare_corpus(args.inputs, args.out, text_field=args.text_field, separator=separator,
                       val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                       workers=args.workers, skip_bad_lines=args.skip_bad_lines,
                       progress=args.progress, batch_chars=max(1, int(args.batch_mb * 1e6)),
                       tokenizer_spec=args.tokenizer)
    except KeyboardInterrupt:
        raise Interrupted(args.out) from None


class Interrupted(Exception):
    """Ctrl-C: what was recorded stays; the same command resumes after it (corpus.py)."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_main(_prepare, argv)
    except (Interrupted, KeyboardInterrupt) as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this line short
        where = (f"{e.args[0]} keeps what was prepared; " if isinstance(e, Interrupted)
                 and Path(e.args[0]).exists() else "")
        print(f"interrupted: {where}run the same command again to "
              f"{'resume' if where else 'prepare'}", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
