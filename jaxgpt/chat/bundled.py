"""The bundled chat set (`data.chat=bundled`): conversations generated here, no download.

A small model fine-tuned on it in minutes on a CPU (configs/sft-tiny.yaml) visibly learns the chat
format: it answers in the assistant's turn, in the set's short sentences, and ends its turn. The
conversations are made from templates and a seeded random generator, so the file is the same on
every machine: greetings and thanks, sums and differences of small numbers, the letters of a word
(counted, reversed, capitalised), capitals of a few countries, a line of the bundled Shakespeare;
some with a system message, about a third with two or three user turns.

The JSON Lines file is written once into the jaxgpt cache directory (`bundled_chats`), where
`data.chat=bundled` reads it like any other chat file; `python -m jaxgpt.chat.bundled OUT` writes
a copy to look at or to edit.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

from jaxgpt import files

VERSION = 1
CONVERSATIONS = 4000
_SHAKESPEARE = Path(__file__).resolve().parent.parent / "assets" / "tinyshakespeare.txt"
WORDS = ("apple", "river", "garden", "window", "castle", "silver", "forest", "candle", "dragon", "pencil", "music",
         "orange", "planet", "rabbit", "summer", "winter", "yellow", "bridge", "cookie", "lantern", "mirror", "ocean",
         "puzzle", "rocket", "shadow", "tiger", "violet", "wizard", "zebra", "anchor")
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
            "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
            "Greece": "Athens", "Chile": "Santiago", "India": "New Delhi", "Brazil": "Brasilia"}
SYSTEMS = ("You are a helpful assistant.", "Answer in one short sentence.", "You are a friendly assistant.")


def _shakespeare_lines() -> list[str]:
    lines = [line.strip() for line in _SHAKESPEARE.read_text().splitlines()]
    return [line for line in lines if 30 <= len(line) <= 70 and not line.endswith(":")]


def _turn(rng: random.Random, verses: list[str]) -> tuple[str, str]:
    """One (user, assistant) exchange."""
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice(("Hi!", "Hello.", "Hello there!", "Good morning!", "Hey.")), rng.choice(
            ("Hello! How can I help you today?", "Hi! What can I do for you?"))
    if kind == 1:
        a, b = rng.randrange(20), rng.randrange(20)
        return rng.choice((f"What is {a} + {b}?", f"Add {a} and {b}.", f"{a} plus {b}?")), f"{a} + {b} = {a + b}."
    if kind == 2:
        a = rng.randrange(10, 30)
        b = rng.randrange(a)
        return rng.choice((f"What is {a} - {b}?", f"Subtract {b} from {a}.")), f"{a} - {b} = {a - b}."
    word = rng.choice(WORDS)
    if kind == 3:
        return f"How many letters are in the word {word}?", f"The word {word} has {len(word)} letters."
    if kind == 4:
        return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
    if kind == 5:
        return f"Write {word} in capital letters.", f"{word.upper()}"
    if kind == 6:
        country = rng.choice(list(CAPITALS))
        return rng.choice((f"What is the capital of {country}?", f"Which city is the capital of {country}?")), \
            f"The capital of {country} is {CAPITALS[country]}."
    if kind == 7:
        return rng.choice(("Give me a line from Shakespeare.", "Quote Shakespeare.")), f'"{rng.choice(verses)}"'
    return rng.choice(("Thank you!", "Thanks.", "Thanks a lot!")), rng.choice(("You're welcome!", "Glad to help!"))


def conversations(n: int = CONVERSATIONS, seed: int = 0) -> list[dict]:
    """The bundled set: n conversations, the same for a given seed."""
    rng, verses, out = random.Random(seed), _shakespeare_lines(), []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 2, 3))):
            user, assistant = _turn(rng, verses)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        out.append({"messages": messages})
    return out


def write(path: Path, n: int = CONVERSATIONS) -> Path:
    """The set as JSON Lines at `path`, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations(n))
    os.chmod(tmp, 0o666 & ~files.umask())
    os.replace(tmp, path)
    return path


def bundled_chats() -> Path:
    """The bundled set's JSON Lines file in the jaxgpt cache directory, written on first use."""
    path = files.cache_dir() / f"chat-bundled-v{VERSION}.jsonl"
    return path if path.is_file() else write(path)


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bundled-chats.jsonl")))
