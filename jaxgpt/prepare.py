"""`python -m jaxgpt.prepare FILE [FILE ...] --out DIR [--val-fraction 0.1]`: text -> token files.

All the work is `jaxgpt.data.prepare`; mistakes a user can fix are one `error: ...` line on stderr
and exit code 2, with no traceback.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

from jaxgpt.data import prepare
from jaxgpt.cli import ArgumentParser, run_main


def _prepare(argv: Sequence[str] | None) -> None:
    parser = ArgumentParser(prog="python -m jaxgpt.prepare",
                     description="Tokenize text files with GPT-2 BPE into train.bin, val.bin "
                                 "and meta.json.")
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="UTF-8 text files")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="fraction of the characters (the end) kept for validation")
    args = parser.parse_args(argv)
    meta = prepare(args.files, args.out, val_fraction=args.val_fraction)
    print(f"wrote {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens to "
          f"{args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_prepare, argv)


if __name__ == "__main__":
    sys.exit(main())
