"""Reading files jaxgpt did not just write, and checking paths before writing under them.

Every file a command reads (a data dir's meta.json, an HF config.json, metrics.jsonl,
events.jsonl, a config YAML, a prompt file) can be missing, a directory, not UTF-8, not
parseable, or parse into the wrong shape (a list where an object belongs, a key missing, a string
where a number belongs). Each of those is one `UserError` sentence naming the file, what it was
read as, and what is wrong; callers never see a `KeyError` or an `AttributeError` from a file.

A shape is a mapping key -> allowed types (`NUMBER`, `int`, `str`, ...): `required` keys must be
present with such a value, `optional` ones are checked only where present. `int` never admits a
bool, although Python's `bool` is an `int`.

metrics.jsonl and events.jsonl are appended to by a process that may be killed mid-line, so a last
line without its newline that does not parse is a write cut short and is skipped (train.py trims it
on resume); any other bad line is an error naming its line number.

Paths a command writes under (a run dir, an export dir) are checked with `writable_dir` before
anything is written or compiled: a regular file where a directory must go, or a directory where a
file must go, is said to be what it is, instead of surfacing later as FileExistsError or
NotADirectoryError from deep inside Orbax or TensorBoard.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from jaxgpt.errors import UserError

NUMBER = (int, float)
Shape = Mapping[str, type | tuple[type, ...]]

_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}


def kind(path: Path) -> str:
    """'a directory', 'a file', 'missing', ... : what is at `path` now (symlinks followed)."""
    path = Path(path)
    if path.is_dir():
        return "a directory"
    if path.is_file():
        return "a file"
    if path.exists():
        return "not a regular file (a device, socket or pipe)"
    return "missing"


def require_file(path: Path, what: str) -> Path:
    """`path` if it is a regular file; otherwise UserError saying what it is instead."""
    path = Path(path)
    if not path.is_file():
        there = kind(path)
        raise UserError(f"{what} {path} does not exist" if there == "missing"
                        else f"{what} {path} is {there}, not a file")
    return path


def require_dir(path: Path, what: str) -> Path:
    """`path` if it is a directory; otherwise UserError saying what it is instead."""
    path = Path(path)
    if not path.is_dir():
        there = kind(path)
        raise UserError(f"{what} {path} does not exist" if there == "missing"
                        else f"{what} {path} is {there}, not a directory")
    return path


def writable_dir(path: Path, what: str, files: Iterable[str] = (), dirs: Iterable[str] = (),
                 access: bool = True) -> Path:
    """Checks that `path` can be (or already is) a directory holding the named files and subdirs.

    Nothing is created. Fails when `path` or one of its parents exists as a non-directory, when
    a named entry exists as the wrong kind (a file called `checkpoints`, a directory called
    `metrics.jsonl`), or when `path` (else the nearest parent that exists) or an existing named entry
    cannot be written by this process (access(2): a read-only mount, an immutable file, another
    user's): found before any work, not at the first save. access=False skips the last check.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is {kind(path)}, not a directory")
    for parent in reversed(path.absolute().parents):
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{what} {path} cannot be a directory: its parent {parent} is {kind(parent)}")
    nearest = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    require = _require_access if access else (lambda *_: None)
    require(nearest, f"{what} {path} cannot be written: {nearest}" if nearest != path.absolute()
                    else f"{what} {path} cannot be written")
    for name in files:
        entry = path / name
        if entry.exists() and not entry.is_file():
            raise UserError(f"{entry} in {what} {path} is {kind(entry)}, but jaxgpt writes a file there; move it away")
        require(entry, f"{entry} in {what} {path} cannot be written")
    for name in dirs:
        entry = path / name
        if entry.exists() and not entry.is_dir():
            raise UserError(f"{entry} in {what} {path} is {kind(entry)}, but jaxgpt keeps a directory there; "
                            f"move it away")
        require(entry, f"{entry} in {what} {path} cannot be written")
    return path


def _require_access(path: Path, message: str) -> None:
    """UserError(message + why) when `path` exists and this process may not write it (a directory:
    create entries in it)."""
    if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
        raise UserError(f"{message}: it is read-only or not writable by this user (a read-only mount, an "
                        f"immutable file or another user's); fix its permissions or choose another path")


def umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread at once)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def write_text_atomically(path: Path, text: str) -> None:
    """`path` holds `text` whole or keeps its old content (a kill mid-write leaves a dot-file beside
    it); a symlink there is replaced, never written through to a file outside the directory. The
    temporary file has a fresh name (two writers never share one) and the umask's mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_unicode(text: str) -> bool:
    """False for a str holding lone surrogates (JSON's "\\ud800" escape decodes to one; bytes that
    are not UTF-8 reach sys.argv as them), which no UTF-8 encoder, the tokenizer's included, accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def remove_leftovers(path: Path) -> None:
    """Deletes the temporary files that write_text_atomically(path, ...) calls killed before their
    rename left beside `path`. Only for a path one process writes (a run dir's own files)."""
    path = Path(path)
    for left in path.parent.glob(f".{path.name}.*.tmp"):
        left.unlink(missing_ok=True)


def writable_file(path: Path, what: str) -> Path:
    """`path` if a file can be written there: its directory exists and it is not itself a directory."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UserError(f"{what} {path} is {kind(path)}, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UserError(f"{what} {path} cannot be written: {parent} "
                        + ("does not exist" if kind(parent) == "missing" else f"is {kind(parent)}"))
    return path


def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file's content with universal newlines, as `open(path).read()` gives it, or
    UserError (missing, a directory, unreadable, not UTF-8)."""
    path = require_file(path, what)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{what} {path} cannot be read ({e.strerror})") from None
    try:
        return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in words: "an object", "a list", "an integer", "null", ..."""
    return next((name for t, name in _JSON_NAMES.items() if type(value) is t), type(value).__name__)


def _allowed(value: Any, types: type | tuple[type, ...]) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    if set(types) >= set(NUMBER):
        types = (float, *(t for t in types if t not in NUMBER))
    return " or ".join(_JSON_NAMES.get(t, t.__name__) for t in types)


def check_shape(obj: Any, where: str, required: Shape = {}, optional: Shape = {}) -> dict[str, Any]:
    """`obj` if it is a mapping whose keys have the allowed types; `where` starts the error message."""
    if not isinstance(obj, dict):
        raise UserError(f"{where} holds {json_kind(obj)}, not an object of keys and values")
    missing = [k for k in required if k not in obj]
    if missing:
        raise UserError(f"{where} lacks the key{'s' if len(missing) > 1 else ''} "
                        + ", ".join(f"'{k}'" for k in missing))
    for key, types in {**optional, **required}.items():
        if key in obj and not _allowed(obj[key], types):
            raise UserError(f"{where}: '{key}' is {json_kind(obj[key])} ({obj[key]!r:.40}), "
                            f"not {_type_names(types)}")
    return obj


def read_json_object(path: Path, what: str, required: Shape = {}, optional: Shape = {}) -> dict[str, Any]:
    """A JSON file that must hold one object with the given keys."""
    path = Path(path)
    text = read_text(path, what)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return check_shape(obj, f"{what} {path}", required, optional)


def read_jsonl(path: Path, what: str, required: Shape = {}, optional: Shape = {}) -> list[dict[str, Any]]:
    """One JSON object per line (blank lines ignored); a last line cut short by a kill is dropped."""
    path = Path(path)
    text = read_text(path, what)
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: the writer was killed mid-line
                break
            raise UserError(f"{what} {path}: line {number} is not valid JSON ({e.msg}): {line.strip()!r:.60}") from None
        rows.append(check_shape(obj, f"{what} {path}: line {number}", required, optional))
    return rows


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader with two changes. A key given twice in one mapping is an error:
    PyYAML keeps the last one silently, so a config with two `train:` sections would lose the
    first. And numbers are read as YAML 1.2 (and Python) read them, not as YAML 1.1 does: `010` is
    ten, not octal eight; `1:30` is text, not the base-60 number 90; `1e-3` is a float, not text;
    hex, octal and binary forms are text (a config key that wants a number says so)."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(_INT_TAG, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))


def _decimal_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    try:
        return int(text, 10)
    except ValueError:  # more digits than Python converts (4,300): no config value is near that
        raise yaml.constructor.ConstructorError(None, None, f"the number {text[:20]}... has {len(text):,} characters",
                                                node.start_mark) from None


def _float(loader: _StrictLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_StrictLoader.add_constructor(_INT_TAG, _decimal_int)
_StrictLoader.add_constructor(_FLOAT_TAG, _float)


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a {type(key).__name__} cannot be a key (line {key_node.start_mark.line + 1})",
                key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(text: str) -> Any:
    """yaml.safe_load with _StrictLoader's two changes. Every way the text can fail is a
    yaml.YAMLError, nesting too deep for the parser's recursion included."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("it is nested too deeply") from None


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file holding a mapping (or nothing: {}); UserError for anything else."""
    path = Path(path)
    text = read_text(path, what)
    try:
        tree = load_yaml(text)
    except yaml.YAMLError as e:
        raise UserError(f"{what} {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UserError(f"{what} {path} holds a YAML {type(tree).__name__}, not a mapping of keys to values")
    return tree


def cache_dir() -> Path:
    """jaxgpt's cache directory: JAXGPT_CACHE, else $XDG_CACHE_HOME/jaxgpt, else ~/.cache/jaxgpt."""
    if "JAXGPT_CACHE" in os.environ:
        return Path(os.environ["JAXGPT_CACHE"])
    if "XDG_CACHE_HOME" in os.environ:
        return Path(os.environ["XDG_CACHE_HOME"]) / "jaxgpt"
    return Path.home() / ".cache" / "jaxgpt"
