"""Issue 62: the README's and each guide's first example run in CI, so a command the docs show
cannot rot; the configuration reference is what its generator writes; the exit-code table is the
code's; `.ci/run` runs the README's test command exactly.

The examples: the first ```bash block of README.md and of every guide in docs/ (all but the tables,
design.md and history/) is read line by line and each command run, in one workspace shared in a
fixed order, so the examples chain as they do for a reader (README's default run, then the guides
that resume, sample, export, evaluate and report it). Commands run in this process where they are
jaxgpt's (`python -m jaxgpt.X ARGS` calls X's `main(ARGS)`: no interpreter start, no import, on the
session's 8 fake devices), `./launch_multihost.sh` in a subprocess. What changes is the size, and
only for keys the command does not set itself: `python -m jaxgpt.train` and `jaxgpt.plan` (and the
launcher's train arguments) get the tests' tiny model (tests/helpers.py TINY, one micro-batch, a
checkpoint at the end), and every count of steps is divided by 100 (train.steps 300 -> 3, a
command's own train.steps=400 -> 4). Setup steps (`bash scripts/venv.sh`, `. .venv/bin/activate`,
`pip install -e ".[EXTRAS]"`) are what CI's install already did, checked rather than run.

A command line may end with `# exit N` or `# exit N: TEXT`: its expected exit code, and a text its
stderr must hold (errors.md shows its error lines this way); otherwise it must exit 0.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from helpers import REPO, TINY, main_in_process, xla_flags

from jaxgpt import cli

# README first (the others use its run), then the guides in the order they chain; guides this list
# does not name run after these, alphabetically (a new guide's first example runs without a change here).
ORDER = ["README.md", "parallelism.md", "checkpoints.md", "huggingface.md", "evaluation.md", "metrics.md",
         "data.md", "models.md", "gpus.md", "multihost.md", "config.md", "errors.md"]
NOT_GUIDES = {"benchmarks.md", "design.md"}
# TINY's model and batch in one micro-batch, the loss chunk left to auto (one chunk: the least to
# compile), a checkpoint at the end only; the tokenizer the command or its config names (GPT-2's
# by default, as users run them), not TINY's small one
SIZE = dict(item.split("=", 1) for item in [*TINY, "train.grad_accum=1", "checkpoint.every=0"]
            if item.split("=")[0] not in ("model.loss_chunk", "data.tokenizer", "model.vocab_size"))
STEPS = {"train.steps": 300}  # the default, divided by 100 where a command leaves it
STEP_KEYS = {"train.steps", "checkpoint.every", "train.eval_every", "eval.task_every", "logging.every"}
SIZED = {"jaxgpt.train", "jaxgpt.plan"}
# a bundled config whose example needs more than TINY's 32 positions: sft-tiny's chat (a templated
# question of 34 tokens and its answer) is sampled from its run
CONFIG_SIZE = {"sft-tiny": {"model.seq_len": "128"}}
EXPECT = re.compile(r"\s#\s*exit (\d+)(?::\s*(.*?))?\s*$")


def documents() -> list[str]:
    guides = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name not in NOT_GUIDES)
    return [n for n in ORDER if n == "README.md" or n in guides] + [g for g in guides if g not in ORDER]


def path_of(name: str) -> Path:
    return REPO / name if name == "README.md" else REPO / "docs" / name


def bash_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL)


def first_example(name: str) -> list[str]:
    """The command lines of the document's first bash block, continuation lines joined."""
    blocks = bash_blocks(path_of(name).read_text())
    assert blocks, f"{name} has no ```bash example"
    return [line for line in blocks[0].replace("\\\n", " ").splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def ci_command() -> str:
    return (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]


def sized(module: str, args: list[str]) -> list[str]:
    """A jaxgpt.train or jaxgpt.plan command's arguments with the tiny model and steps / 100."""
    out, given = [], set()
    for a in args:
        key, sep, value = a.partition("=")
        if sep and "." in key and not key.startswith("-"):
            given.add(key)
            if key in STEP_KEYS and value.isdigit():
                a = f"{key}={max(1, int(value) // 100)}"
        out.append(a)
    extra = {**SIZE, **{k: str(v // 100) for k, v in STEPS.items()}} if module in SIZED else {}
    config = args[args.index("--config") + 1] if "--config" in args[:-1] else None
    extra.update(CONFIG_SIZE.get(config, {}) if module in SIZED else {})
    return out + [f"{k}={v}" for k, v in extra.items() if k not in given]


class Workspace:
    """Runs the examples' commands in one directory that stands for a checkout (symlinks to the
    repository's code, configs, scripts and launcher), counting the CPU seconds they take."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root, self.mp = root, monkeypatch
        for name in ("jaxgpt", "configs", "scripts", "launch_multihost.sh"):
            (root / name).symlink_to(REPO / name)
        self.cpu: dict[str, float] = {}

    def run_example(self, name: str) -> list[tuple[str, int, str]]:
        """(command, exit code, stderr) of each command of the document's first example."""
        started = _cpu_seconds()
        results = []
        with contextlib.chdir(self.root):
            for line in first_example(name):
                for command in self._commands(line):
                    results.append(self._run(name, line, command))
        self.cpu[name] = _cpu_seconds() - started
        return results

    @staticmethod
    def _commands(line: str) -> list[list[str]]:
        tokens = shlex.split(line, comments=True)
        out, current = [], []
        for t in tokens:
            if t == "&&":
                out.append(current)
                current = []
            else:
                current.append(t)
        return [c for c in [*out, current] if c]

    def _run(self, name: str, line: str, tokens: list[str]) -> tuple[str, int, str]:
        text = " ".join(tokens)
        env = {}
        while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        head = tokens[0]
        if head == "export":
            for item in tokens[1:]:
                key, _, value = item.partition("=")
                self._setenv(key, value)
            return text, 0, ""
        if head == "pip" or tokens in (["bash", "scripts/venv.sh"], [".", ".venv/bin/activate"]):
            self._check_setup(tokens)
            return text, 0, ""
        if head == "echo" and len(tokens) == 4 and tokens[2] in (">", ">>"):
            with open(tokens[3], "a" if tokens[2] == ">>" else "w") as f:
                f.write(tokens[1] + "\n")
            return text, 0, ""
        expected = EXPECT.search(line)
        code, says = (int(expected.group(1)), expected.group(2)) if expected else (0, None)
        if head == "python" and tokens[1:2] == ["-m"]:
            rc, err = self._module(tokens[2], tokens[3:], env)
        elif head == "./launch_multihost.sh":
            rc, err = self._launch(tokens[1:], env)
        else:
            pytest.fail(f"{name}: the docs test cannot run `{text}` (add it to tests/test_docs.py, or write the "
                        f"example as a command it runs)")
        assert rc == code, f"{name}: `{line.strip()}` exited {rc}, expected {code}:\n{err[-3000:]}"
        if says:
            assert says in err, f"{name}: `{line.strip()}` should say {says!r}; stderr:\n{err[-3000:]}"
        assert "Traceback" not in err, f"{name}: `{line.strip()}`:\n{err[-3000:]}"
        return text, rc, err

    def _setenv(self, key: str, value: str) -> None:
        if key == "XLA_FLAGS":  # JAX started with the session's devices: the example must ask for as many
            count = re.search(r"--xla_force_host_platform_device_count=(\d+)", value)
            assert count and int(count.group(1)) == jax.device_count(), value
            return
        self.mp.setenv(key, value)

    @staticmethod
    def _check_setup(tokens: list[str]) -> None:
        """A setup step: CI's install (.ci/run) must already have done it."""
        ci = ci_command()
        if tokens[0] == "pip":
            extras = re.findall(r"\[([\w,-]+)\]", " ".join(tokens))
            installed = set(re.search(r"\[([\w,-]+)\]", ci).group(1).split(","))
            assert all(set(e.split(",")) <= installed for e in extras), (tokens, ci)
            assert "-e" in tokens and ("." in tokens or extras), tokens
        else:
            assert " ".join(tokens) in ci, (tokens, ci)

    def _module(self, module: str, args: list[str], env: dict[str, str]) -> tuple[int, str]:
        with self.mp.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            mp.setattr(sys, "stdin", io.StringIO("Hello!\n"))  # an interactive command (sample --chat): one line, then EOF
            proc = main_in_process(*sized(module, args), module=module)
        return proc.returncode, proc.stderr

    def _launch(self, args: list[str], env: dict[str, str]) -> tuple[int, str]:
        split = args.index("--") + 1 if "--" in args else len(args)
        args = args[:split] + sized("jaxgpt.train", args[split:])
        env = {**os.environ, **env, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "XLA_FLAGS": xla_flags(None)}
        proc = subprocess.run(["bash", "./launch_multihost.sh", *args], cwd=self.root, env=env, capture_output=True,
                              text=True, timeout=600)
        return proc.returncode, proc.stderr


def _cpu_seconds() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, shakespeare_dir):
    with pytest.MonkeyPatch.context() as mp:
        started = time.perf_counter()
        ws = Workspace(tmp_path_factory.mktemp("docs-examples"), mp)
        yield ws
        print(f"\ndocs examples: {sum(ws.cpu.values()):.1f} CPU s in {time.perf_counter() - started:.1f} s: "
              + ", ".join(f"{n} {s:.1f}" for n, s in ws.cpu.items()))


@pytest.mark.parametrize("name", documents())
def test_the_first_example_runs(workspace, name):
    results = workspace.run_example(name)
    assert results
    if name == "README.md":  # the default run wrote what the README says it writes
        run = workspace.root / "runs" / "shakespeare"
        for item in ("metrics.jsonl", "config.yaml", "checkpoints", "report.md", "loss.png", "events.jsonl", "tb"):
            assert (run / item).exists(), item


def test_ci_runs_the_readmes_test_command_exactly():
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):]
    blocks = bash_blocks(quick)
    assert blocks[1].strip() == ci_command(), "the README's second command is what .ci/run runs"
    assert blocks[0].strip().startswith(ci_command().split(" && pip")[0]) and blocks[0].strip().endswith(
        "python -m jaxgpt.train"), "the first command sets up and trains the default"


def test_the_readme_tour_runs_as_the_guides_first_examples():
    """Each line of the README's tour is a guide's first example (so it runs above)."""
    readme = (REPO / "README.md").read_text()
    tour = bash_blocks(readme[readme.index("## A short tour"):])[0]
    firsts = {shlex.join(shlex.split(line, comments=True)) for name in documents()[1:] for line in first_example(name)}
    for line in tour.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert shlex.join(shlex.split(line, comments=True)) in firsts, line


def test_the_config_reference_is_what_its_generator_writes():
    """docs/config.md is scripts/config_reference.py's output for today's keys (run it after adding one)."""
    from helpers import script_module
    generator = script_module("config_reference")
    assert (REPO / "docs" / "config.md").read_text() == generator.render(), \
        "docs/config.md is out of date: run python scripts/config_reference.py"
    for key in ("model.n_layer", "mesh.fsdp", "checkpoint.every"):
        assert f"| `{key}` |" in generator.render()


def test_the_exit_code_table_is_the_codes_the_cli_defines():
    """errors.md's table holds exactly jaxgpt/cli.py's EXIT_* codes (a new code needs its row)."""
    table = (REPO / "docs" / "errors.md").read_text()
    listed = [int(c) for c in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)]
    defined = sorted({v for k, v in vars(cli).items() if k.startswith("EXIT_") and isinstance(v, int)})
    assert listed == defined, (listed, defined)
