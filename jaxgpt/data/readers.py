"""Input files -> a stream of text pieces, in a fixed order, in bounded memory.

Inputs are files, directories (searched recursively) and globs, each expanded in sorted order.
The format follows the name: `.parquet` is Parquet (a string column), `.jsonl`, `.ndjson` and
`.json` are JSON Lines (one object per line with a string field); anything else is UTF-8 text,
one document per file or several documents split on a separator string. JSON Lines and text may
be compressed as `.gz` or `.zst` (`a.jsonl.zst`, `b.txt.gz`). Text is read with universal
newlines ("\\r\\n" and "\\r" become "\\n"), and a UTF-8 byte-order mark at the start of a text or
JSON Lines file is dropped. Compressed streams are read to their end marker: zstandard's stream
reader ends quietly inside a cut-off frame, so `.zst` files are decoded frame by frame
(`_ZstdStream`) and a cut is an error. With `val_tail` (one text file, corpus.py), a text file is
two documents: its first int(n_chars * (1 - val_tail)) characters and the rest.

A document is yielded as one or more *pieces* `(text, starts_document)`. A long document is cut
into pieces of about MAX_PIECE_CHARS so that no single document has to fit in memory and the
pieces can be tokenized in parallel. The cut is placed only where it cannot change the tokens:
right after a "\\n" that follows a non-space character and precedes one. There tiktoken's GPT-2
pre-tokenizer always ends a pre-token (the "\\n" alone, matched by `\\s`), and BPE never merges
across pre-tokens, so encoding the pieces separately gives exactly the tokens of the whole.
(Python's `\\s` covers every Unicode White_Space character, so the test is never looser than
tiktoken's.) A text without line breaks there (minified JSON, base64, one-line logs) is cut where
an ASCII letter or digit meets an ASCII character of another class, not a space (`"key":` between
`y` and `"`): the pre-tokenizer's letter and number patterns end there, none looks behind, and the
next pre-token starts at the cut whatever preceded it (`class_cut`). A text with neither (one run
of letters, say) stays one piece.

`Reader.pieces(i, skip)` starts file i after its first `skip` pieces: that is how an
interrupted preparation resumes (the file is read again from its start, but not tokenized).
"""

import contextlib
import glob
import gzip
import io
import json
import os
import re
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import zstandard

from jaxgpt.errors import UserError
from jaxgpt.files import is_unicode, json_kind

MAX_PIECE_CHARS = 1 << 20
_READ_CHARS = 1 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSED = (".gz", ".zst")
BOM = b"\xef\xbb\xbf"


def find_inputs(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[Path]:
    """Files, directories (recursively) and globs -> the input files, each group sorted.

    Directories are walked following symbolic links, each real directory once (a link loop ends
    there). A file reached twice (named twice, or through a link) is read once, with a warning.
    Files under `exclude` (the output directory, when it sits inside an input directory) are
    left out, so a re-run never reads its own shards back as input.
    """
    if any(not str(given).strip() for given in inputs):  # '' would be the current directory, walked whole
        raise UserError("an input path is empty; use . for the current directory")
    files: list[Path] = []
    seen: dict[str, Path] = {}
    skip = os.path.realpath(exclude) if exclude is not None else None

    def excluded(real: str) -> bool:
        return skip is not None and (real == skip or real.startswith(skip.rstrip(os.sep) + os.sep))

    for item in map(str, inputs):
        path = Path(item).expanduser()
        if path.is_dir():
            every = sorted(_walk(path))
            found = [p for p in every if not excluded(os.path.realpath(p))]
            if not found:
                raise UserError(f"Input directory {path} holds no files"
                                + (f" besides the output directory {exclude}." if every else "."))
        elif path.exists():
            if not path.is_file():  # /dev/zero, a FIFO: endless or blocking, never a corpus
                raise UserError(f"Input {path} is not a regular file or a directory.")
            found = [path]
        elif glob.has_magic(item):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True)
                           if Path(p).is_file() and not excluded(os.path.realpath(p)))
            if not found:
                raise UserError(f"Input pattern {item!r} matches no files.")
        else:
            raise UserError(f"Input {path} does not exist.")
        for f in found:
            real = os.path.realpath(f)
            if real in seen:
                also = "" if str(seen[real]) == str(f) else f" (also as {seen[real]})"
                print(f"warning: input {f} is named more than once{also}; reading it once",
                      file=sys.stderr, flush=True)
                continue
            seen[real] = f
            files.append(f)
    if not files:
        raise UserError("No input files given to prepare.")
    return files


def _walk(top: Path) -> Iterator[Path]:
    """The visible files under `top`, following directory links, each real directory once; a
    visible entry that is no regular file (a FIFO, a socket, a link to nothing) is skipped with
    one warning line."""
    visited = set()
    for root, dirs, names in os.walk(top, followlinks=True):
        real = os.path.realpath(root)
        if real in visited:
            dirs[:] = []
            continue
        visited.add(real)
        for name in names:
            p = Path(root) / name
            if name.startswith("."):
                continue
            if p.is_file():
                yield p
            else:
                what = "a broken or looping link" if p.is_symlink() and not p.exists() else "not a regular file"
                print(f"warning: skipping {p}: {what}", file=sys.stderr, flush=True)


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


# A run of ASCII letters ends and another class follows, or a run of digits does: a pre-token
# boundary of tiktoken's GPT-2 pattern ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+).
_CLASS_CHANGE = re.compile(r"(?<=[A-Za-z])(?=[0-9!-/:-@\[-`{-~])|(?<=[0-9])(?=[A-Za-z!-/:-@\[-`{-~])")
CLASS_CUT_WINDOW = 1 << 16  # characters searched back from the limit
CUT_RULE = "line breaks, then letter/digit run ends"  # in the preparation's fingerprint


def class_cut(text: str, lo: int, hi: int) -> int:
    """The last position p in (lo, hi], at most CLASS_CUT_WINDOW before hi, where the tokens of
    text[:p] and text[p:] are those of text because a letter or digit run ends there (module
    docstring), or -1."""
    hi = min(hi, len(text) - 1)
    last = -1
    for m in _CLASS_CHANGE.finditer(text, max(lo, hi - CLASS_CUT_WINDOW), hi + 1):
        last = m.start()
    return last if last > lo else -1


def cut_point(text: str, lo: int, hi: int) -> int:
    """A safe cut in (lo, hi]: after a line break where there is one, else at a class change; or -1."""
    p = safe_cut(text, lo, hi)
    return p if p >= 0 else class_cut(text, lo, hi)


def later_cut(text: str, lo: int, hi: int) -> int:
    """Where no cut is found before the limit lo: the first class change in (lo, hi], else the last
    line-break cut there (a longer piece, but still a safe one), or -1."""
    m = _CLASS_CHANGE.search(text, lo + 1, min(hi, len(text) - 1) + 1)
    return m.start() if m else safe_cut(text, lo, hi)


def split_document(text: str, max_chars: int = MAX_PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """One document's pieces (see the module docstring); nothing for an empty document."""
    start, first = 0, True
    while len(text) - start > max_chars:
        p = cut_point(text, start, start + max_chars)
        if p < 0:
            p = later_cut(text, start + max_chars, len(text))
        if p < 0:
            break
        yield text[start:p], first
        start, first = p, False
    if start < len(text):
        yield text[start:], first


class Reader:
    """Pieces of every input file in order; counts skipped bad lines and bytes read."""

    def __init__(self, files: Sequence[Path], *, text_field: str = "text", separator: str | None = None,
                 skip_bad_lines: bool = False, max_chars: int = MAX_PIECE_CHARS,
                 val_tail: float | None = None):
        if separator == "":
            raise UserError("--separator must not be empty.")
        self.files, self.text_field, self.separator = list(files), text_field, separator
        self.val_tail = val_tail  # text files: the last val_tail of the characters is a second document
        self.skip_bad_lines, self.max_chars = skip_bad_lines, max_chars
        self.bad_lines = 0
        self.file_bytes_read = 0  # of the file being read, for progress
        self.skip_hint = "pass --skip-bad-lines"  # how a user skips bad lines (the chat loader's is a config key)

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
            return raw, _ZstdStream(raw)
        return raw, raw

    def _lines(self, path: Path) -> Iterator[tuple[int, bytes]]:
        raw, f = self._open(path)
        with raw, _stream_errors(path):
            for lineno, line in enumerate(io.BufferedReader(f, 1 << 20) if f is not raw else f, 1):
                self.file_bytes_read = raw.tell()
                if lineno == 1 and line.startswith(BOM):  # Notepad's UTF-8 signature
                    line = line[len(BOM):]
                yield lineno, line

    def _bad(self, path: Path, lineno: int, why: str, unit: str = "line") -> None:
        """A bad line (or Parquet row, `unit`): an error naming it, or counted with --skip-bad-lines."""
        if not self.skip_bad_lines:
            where = f"{path}:{lineno}" if unit == "line" else f"{path}: {unit} {lineno}"
            raise UserError(f"{where}: {why}; fix the {unit} or {self.skip_hint} to skip such {unit}s.")
        self.bad_lines += 1

    def objects(self, path: Path) -> Iterator[tuple[int, object]]:
        """(line number, parsed JSON value) of each non-blank line of a JSON Lines file; a line that
        is not UTF-8 JSON is `_bad` (an error, or counted and skipped)."""
        first = True
        for lineno, line in self._lines(path):
            if not line.strip():
                continue
            first, is_first = False, first
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                self._bad(path, lineno, f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)")
                continue
            except json.JSONDecodeError as e:
                if is_first and line.strip() in (b"[", b"{"):
                    _not_lines(path, "one JSON array" if line.strip() == b"[" else "one JSON object "
                               "over several lines")
                self._bad(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if is_first and isinstance(obj, list):
                _not_lines(path, "a JSON array")
            yield lineno, obj

    def _jsonl(self, path: Path) -> Iterator[str]:
        field = self.text_field
        for lineno, obj in self.objects(path):
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                self._bad(path, lineno, f"no {field!r} field (found: {keys or 'none'}); choose the "
                                        "field with --text-field")
                continue
            text = obj[field]
            if not isinstance(text, str):
                self._bad(path, lineno, f"the {field!r} field is {json_kind(text)}, not a string")
                continue
            if not text.isascii() and not is_unicode(text):
                self._bad(path, lineno, f"the {field!r} field holds a lone surrogate escape (such as \\ud800), "
                                        "which is not Unicode text")
                continue
            yield text

    def _parquet(self, path: Path) -> Iterator[str]:
        for row, text in self.column(path, self.text_field, _is_text, "strings", "choose the column with --text-field"):
            if text is None:  # as a JSON Lines null: an error, or counted with --skip-bad-lines
                self._bad(path, row, f"the {self.text_field!r} column is null", unit="row")
            else:
                yield text

    def column(self, path: Path, name: str, of_type, type_name: str, hint: str) -> Iterator[tuple[int, object]]:
        """(row number from 1, value as a Python object) of a Parquet file's column, read page by
        page; `of_type(arrow type)` says whether the column holds `type_name`."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)  # page by page
        except OSError as e:
            raise UserError(f"Cannot read {path}: {e.strerror}.") from None
        except pa.ArrowException as e:
            raise UserError(f"{path} is not a readable Parquet file ({e}).") from None
        names = pf.schema_arrow.names
        if name not in names:
            raise UserError(f"{path} has no column {name!r} (columns: {', '.join(names)}); {hint}.")
        column_type = pf.schema_arrow.field(name).type
        if not of_type(column_type):
            raise UserError(f"Column {name!r} of {path} holds {column_type}, not {type_name}.")
        size, meta = path.stat().st_size, pf.metadata
        total = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)) or 1
        done = row = 0
        try:
            for g in range(meta.num_row_groups):
                for batch in pf.iter_batches(batch_size=1024, row_groups=[g], columns=[name]):
                    for value in batch.column(0).to_pylist():
                        row += 1
                        yield row, value
                done += meta.row_group(g).total_byte_size
                self.file_bytes_read = size * done // total
        except pa.ArrowException as e:
            raise UserError(f"Cannot read {path}: {e}.") from None

    def _chunks(self, path: Path) -> Iterator[str]:
        """The decoded text in chunks of _READ_CHARS characters, then "" at the end."""
        raw, f = self._open(path)
        text = io.TextIOWrapper(f if f is raw else io.BufferedReader(f, 1 << 20), encoding="utf-8-sig",
                                newline=None)  # a leading BOM is not text
        with raw, _stream_errors(path):
            while True:
                try:
                    chunk = text.read(_READ_CHARS)
                except UnicodeDecodeError as e:
                    raise UserError(f"{path} is not valid UTF-8 ({e.reason}); convert it to UTF-8.") from None
                self.file_bytes_read = raw.tell()
                yield chunk
                if not chunk:
                    return

    def tail_cut(self, path: Path) -> tuple[int, int]:
        """(characters, where the tail starts) of a text file read as one document (val_tail)."""
        n = sum(map(len, self._chunks(path)))
        return n, int(n * (1.0 - self.val_tail))

    def _text(self, path: Path) -> Iterator[list[tuple[str, bool]]]:
        """Pieces (not whole documents): one text file may be far larger than memory."""
        chunks = self._chunks(path)
        if self.val_tail is not None:
            chunks = _cut_at(chunks, self.tail_cut(path)[1])
        sep, buf, first = self.separator, "", True
        for chunk in chunks:
            out = []
            if chunk is _CUT:  # the document ends here; what follows is another (val_tail)
                out.extend(_continue(split_document(buf, self.max_chars), first))
                buf, first = "", True
                yield out
                continue
            buf += chunk
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
                p = cut_point(buf, 0, self.max_chars)
                if p < 0:
                    p = later_cut(buf, self.max_chars, limit)
                if p < 0:
                    break
                out.append((buf[:p], first))
                buf, first, limit = buf[p:], False, limit - p
            yield out


_CUT = object()


@contextlib.contextmanager
def _stream_errors(path: Path):
    """A compressed stream cut short or damaged, or a file that cannot be read: one UserError."""
    try:
        yield
    except (EOFError, Truncated) as e:  # a stream cut short, whatever --skip-bad-lines says
        kind = "zstd" if isinstance(e, Truncated) else "gzip"
        raise UserError(f"{path} is cut short: its {kind} stream ends before its end marker "
                        "(an interrupted download or copy?); fetch the file again.") from None
    except (OSError, zlib.error, zstandard.ZstdError) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(f"Cannot read {path}: {e} (a damaged or wrongly named file?).") from None


def _continue(pieces: Iterator[tuple[str, bool]], first: bool) -> Iterator[tuple[str, bool]]:
    """A document's pieces, the first marked as a start only if the document starts here."""
    for i, (text, _) in enumerate(pieces):
        yield text, first and i == 0


def _cut_at(chunks: Iterator[str], cut: int) -> Iterator:
    """The chunks (ending with "") with _CUT inserted after exactly `cut` characters."""
    seen = 0
    for chunk in chunks:
        eof = not chunk
        if seen is not None and (seen + len(chunk) > cut or eof):
            k = max(cut - seen, 0)
            if k:
                yield chunk[:k]
            yield _CUT
            chunk, seen = chunk[k:], None
        elif seen is not None:
            seen += len(chunk)
        if chunk or eof:
            yield chunk


def _not_lines(path: Path, what: str) -> None:
    raise UserError(f"{path} holds {what}, not JSON Lines (one object per line); convert it, e.g. "
                    f"`jq -c '.[]' {path} > {path.with_suffix('.jsonl').name}`.")


def _is_text(t) -> bool:
    """Every Arrow string type (string, large_string, string_view), dictionary-encoded or not."""
    import pyarrow as pa
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


class Truncated(Exception):
    """A compressed stream ended inside a frame."""


class _ZstdStream(io.RawIOBase):
    """A zstd file's decompressed bytes, every frame, read to the end of the last frame.

    zstandard's `stream_reader` returns a clean end of file when the input stops inside a frame,
    so a truncated file would read as a shorter one; this reader raises `Truncated` instead.
    """

    def __init__(self, raw):
        self.raw, self.out, self.pos, self.in_frame = raw, b"", 0, False
        self.dctx = zstandard.ZstdDecompressor()
        self.dobj = self.dctx.decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.pos == len(self.out):
            chunk = self.raw.read(_READ_CHARS)
            if not chunk:
                if self.in_frame:
                    raise Truncated
                return 0
            out = []
            while chunk:
                self.in_frame = True
                out.append(self.dobj.decompress(chunk))
                chunk = b""
                if self.dobj.eof:  # a frame ended: the rest of the chunk starts the next one
                    chunk, self.in_frame = self.dobj.unused_data, False
                    self.dobj = self.dctx.decompressobj()
            self.out, self.pos = b"".join(out), 0
        n = min(len(buffer), len(self.out) - self.pos)
        buffer[:n] = self.out[self.pos:self.pos + n]
        self.pos += n
        return n
