"""Input files -> a stream of text pieces, in a fixed order, in bounded memory.

Inputs are files, directories (searched recursively) and globs, each expanded in sorted order.
The format follows the name: `.parquet` is Parquet (a string column), `.jsonl`, `.ndjson` and
`.json` are JSON Lines (one object per line with a string field), optionally compressed as
`.gz` or `.zst`; anything else is UTF-8 text, one document per file or several documents split
on a separator string. Text is read with universal newlines ("\\r\\n" and "\\r" become "\\n").

A document is yielded as one or more *pieces* `(text, starts_document)`. A long document is cut
into pieces of about MAX_PIECE_CHARS so that no single document has to fit in memory and the
pieces can be tokenized in parallel. The cut is placed only where it cannot change the tokens:
right after a "\\n" that follows a non-space character and precedes one. There tiktoken's GPT-2
pre-tokenizer always ends a pre-token (the "\\n" alone, matched by `\\s`), and BPE never merges
across pre-tokens, so encoding the pieces separately gives exactly the tokens of the whole.
(Python's `\\s` covers every Unicode White_Space character, so the test is never looser than
tiktoken's.) A text without such a point (no line breaks at all) stays one piece.

`Reader.pieces(i, skip)` starts file i after its first `skip` pieces: that is how an
interrupted preparation resumes (the file is read again from its start, but not tokenized).
"""

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import zstandard

from jaxgpt.errors import UserError

MAX_PIECE_CHARS = 1 << 20
_READ_CHARS = 1 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSED = (".gz", ".zst")


def find_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files, directories (recursively) and globs -> the input files, each group sorted."""
    files: list[Path] = []
    for item in map(str, inputs):
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not found:
                raise UserError(f"Input directory {path} holds no files.")
        elif path.exists():
            found = [path]
        elif glob.has_magic(item):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True)
                           if Path(p).is_file())
            if not found:
                raise UserError(f"Input pattern {item!r} matches no files.")
        else:
            raise UserError(f"Input {path} does not exist.")
        files.extend(found)
    if not files:
        raise UserError("No input files given to prepare.")
    return files


def kind(path: Path) -> str:
    """'parquet', 'jsonl' or 'text', from the file name."""
    name = path.name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "text"


def safe_cut(text: str, lo: int, hi: int) -> int:
    """The last position p in (lo, hi] where text[:p] / text[p:] tokenize independently, or -1."""
    hi = min(hi, len(text) - 1)
    while hi > lo:
        p = text.rfind("\n", lo, hi) + 1  # a cut right after this "\n"
        if p <= lo or p < 2:
            return -1
        if not text[p - 2].isspace() and not text[p].isspace():
            return p
        hi = p - 1
    return -1


def split_document(text: str, max_chars: int = MAX_PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """One document's pieces (see the module docstring); nothing for an empty document."""
    start, first = 0, True
    while len(text) - start > max_chars:
        p = safe_cut(text, start, start + max_chars)
        if p < 0:
            p = safe_cut(text, start + max_chars, len(text))  # a longer piece, but still a safe one
        if p < 0:
            break
        yield text[start:p], first
        start, first = p, False
    if start < len(text):
        yield text[start:], first


class Reader:
    """Pieces of every input file in order; counts skipped bad lines and bytes read."""

    def __init__(self, files: Sequence[Path], *, text_field: str = "text", separator: str | None = None,
                 skip_bad_lines: bool = False, max_chars: int = MAX_PIECE_CHARS):
        if separator == "":
            raise UserError("--separator must not be empty.")
        self.files, self.text_field, self.separator = list(files), text_field, separator
        self.skip_bad_lines, self.max_chars = skip_bad_lines, max_chars
        self.bad_lines = 0
        self.file_bytes_read = 0  # of the file being read, for progress

    def pieces(self, index: int, skip: int = 0, bad_lines: int | None = None) -> Iterator[tuple[str, bool]]:
        """File `index`'s pieces after its first `skip`; `bad_lines`: the count once they are skipped.

        (Skipped pieces are read again, so their bad lines would otherwise be counted twice.)
        """
        path = self.files[index]
        self.file_bytes_read = 0
        if skip == 0 and bad_lines is not None:
            self.bad_lines = bad_lines
        docs = {"parquet": self._parquet, "jsonl": self._jsonl, "text": self._text}[kind(path)](path)
        n = 0
        for doc in docs:
            for piece in (split_document(doc, self.max_chars) if isinstance(doc, str) else doc):
                if n >= skip:
                    yield piece
                n += 1
                if n == skip and bad_lines is not None:
                    self.bad_lines = bad_lines

    # ------------------------------------------------------------ formats

    def _open(self, path: Path):
        try:
            raw = open(path, "rb")
        except OSError as e:
            raise UserError(f"Cannot read {path}: {e.strerror}.") from None
        name = path.name.lower()
        if name.endswith(".gz"):
            return raw, gzip.GzipFile(fileobj=raw)
        if name.endswith(".zst"):
            return raw, zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return raw, raw

    def _lines(self, path: Path) -> Iterator[tuple[int, bytes]]:
        raw, f = self._open(path)
        with raw:
            try:
                for lineno, line in enumerate(io.BufferedReader(f, 1 << 20) if f is not raw else f, 1):
                    self.file_bytes_read = raw.tell()
                    yield lineno, line
            except (OSError, EOFError, zstandard.ZstdError) as e:  # gzip.BadGzipFile is an OSError
                raise UserError(f"Cannot read {path}: {e} (a damaged or wrongly named file?).") from None

    def _bad(self, path: Path, lineno: int, why: str) -> None:
        if not self.skip_bad_lines:
            raise UserError(f"{path}:{lineno}: {why}; fix the line or pass --skip-bad-lines to skip "
                            "such lines.")
        self.bad_lines += 1

    def _jsonl(self, path: Path) -> Iterator[str]:
        field = self.text_field
        for lineno, line in self._lines(path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                self._bad(path, lineno, f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)")
                continue
            except json.JSONDecodeError as e:
                self._bad(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                self._bad(path, lineno, f"no {field!r} field (found: {keys or 'none'}); choose the "
                                        "field with --text-field")
                continue
            text = obj[field]
            if not isinstance(text, str):
                self._bad(path, lineno, f"the {field!r} field is a {type(text).__name__}, not a string")
                continue
            yield text

    def _parquet(self, path: Path) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)  # page by page
        except OSError as e:
            raise UserError(f"Cannot read {path}: {e.strerror}.") from None
        except pa.ArrowException as e:
            raise UserError(f"{path} is not a readable Parquet file ({e}).") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise UserError(f"{path} has no column {self.text_field!r} (columns: {', '.join(names)}); "
                            "choose the column with --text-field.")
        column_type = pf.schema_arrow.field(self.text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise UserError(f"Column {self.text_field!r} of {path} holds {column_type}, not strings.")
        size, meta = path.stat().st_size, pf.metadata
        total = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)) or 1
        done = 0
        try:
            for g in range(meta.num_row_groups):
                for batch in pf.iter_batches(batch_size=1024, row_groups=[g], columns=[self.text_field]):
                    for text in batch.column(0).to_pylist():
                        if text is not None:
                            yield text
                done += meta.row_group(g).total_byte_size
                self.file_bytes_read = size * done // total
        except pa.ArrowException as e:
            raise UserError(f"Cannot read {path}: {e}.") from None

    def _text(self, path: Path) -> Iterator[list[tuple[str, bool]]]:
        """Pieces (not whole documents): one text file may be far larger than memory."""
        try:
            f = open(path, encoding="utf-8", newline=None)
        except OSError as e:
            raise UserError(f"Cannot read {path}: {e.strerror}.") from None
        sep, buf, first = self.separator, "", True
        with f:
            while True:
                try:
                    chunk = f.read(_READ_CHARS)
                except UnicodeDecodeError as e:
                    raise UserError(f"{path} is not valid UTF-8 ({e.reason}); convert it to UTF-8.") from None
                self.file_bytes_read = f.buffer.tell()
                buf += chunk
                out = []
                if sep is not None:
                    *docs, buf = buf.split(sep)
                    for doc in docs:
                        out.extend(_continue(split_document(doc, self.max_chars), first))
                        first = True
                if not chunk:
                    out.extend(_continue(split_document(buf, self.max_chars), first))
                    yield out
                    return
                # A long document: emit its head where it is safe, keeping a possible separator whole.
                limit = len(buf) - (len(sep) - 1 if sep else 0)
                while limit > self.max_chars:
                    p = safe_cut(buf, 0, self.max_chars)
                    if p < 0:
                        p = safe_cut(buf, 0, limit)  # a longer piece, but still a safe one
                    if p < 0:
                        break
                    out.append((buf[:p], first))
                    buf, first, limit = buf[p:], False, limit - p
                yield out


def _continue(pieces: Iterator[tuple[str, bool]], first: bool) -> Iterator[tuple[str, bool]]:
    """A document's pieces, the first marked as a start only if the document starts here."""
    for i, (text, _) in enumerate(pieces):
        yield text, first and i == 0
