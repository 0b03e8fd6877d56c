"""Shared test helpers: a tiny config, a runner for the real CLI, and (from jaxgpt.hlo) HLO reading."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from jaxgpt.checkpoint import Checkpointer
from jaxgpt.config import load_config, validate
from jaxgpt.hlo import while_bodies
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import abstract_state, init_state, make_setup, make_train_step
from jaxgpt.tokenizer import EOT_ID

REPO = Path(__file__).resolve().parent.parent

# The tiny model's tokenizer: a byte-level BPE of 1,159 tokens trained on the bundled text
# (qwen_tokenizer(dir, merges=900) below wrote it; <|endoftext|> is 1156). GPT-2's 50,257 tokens
# would be ~90% of a tiny step's time (its head, its loss over 50,304 logits a position, its
# table's gradient and AdamW); 1,159 still pads (to 1,280 rows) and still learns visibly in 5 steps.
TINY_TOKENIZER = REPO / "tests" / "data" / "tiny-bpe" / "tokenizer.json"
TINY_VOCAB, TINY_PADDED_VOCAB, TINY_EOT = 1159, 1280, 1156
# A test whose property is GPT-2's vocabulary (its padding, its text, its tokenizer) adds these after TINY.
GPT2_VOCAB = ["data.tokenizer=gpt2", "model.vocab_size=50257", f"model.document_token={EOT_ID}"]

# Small enough to compile and step in seconds on 2 cores; every axis still divides by 2 (and 8).
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.seq_len=32",
        "train.batch_size=16", "train.eval_every=0", "logging.every=1", "optimizer.warmup_steps=2",
        "model.loss_chunk=8",  # the fused loss over 4 chunks in every layout (auto would take 1 here)
        f"data.tokenizer={TINY_TOKENIZER}", f"model.vocab_size={TINY_VOCAB}"]
# model.document_mask splits windows at TINY_EOT (the default, 50256, is GPT-2's <|endoftext|>)
TINY_DOCUMENTS = ["model.document_mask=true", f"model.document_token={TINY_EOT}"]


def layer_loops(hlo: str, padded_vocab: int = TINY_PADDED_VOCAB, vocab: int = TINY_VOCAB) -> list[str]:
    """The while-loop bodies of the scanned layers: every loop but the fused loss's chunks, which
    are the ones with a vocabulary-sized dimension (the [V, D] embedding gradient they carry, the
    padded V or, where the loss takes the table's real rows on a CPU, the real one;
    jaxgpt/lowering/loss.py)."""
    return [body for body in while_bodies(hlo) if not _has_vocab_dim(body, padded_vocab, vocab)]


def loss_loops(hlo: str, padded_vocab: int = TINY_PADDED_VOCAB, vocab: int = TINY_VOCAB) -> list[str]:
    return [body for body in while_bodies(hlo) if _has_vocab_dim(body, padded_vocab, vocab)]


def _has_vocab_dim(body: str, *sizes: int) -> bool:
    return re.search(r"[\[,](%s)[\],]" % "|".join(map(str, sizes)), body) is not None


def tiny_config(*overrides: str, mesh: str | None = None):
    return load_config(None, [*TINY, *overrides], mesh)


def gpt2_tiny_config(*overrides: str, mesh: str | None = None):
    """The tiny model with GPT-2's vocabulary (50,257 rows padded to 50,304), for the files whose
    property it is: the default run's compiled head, loss and table; GPT-2's Hugging Face files."""
    return tiny_config(*GPT2_VOCAB, *overrides, mesh=mesh)


def lowering(model_cfg, ops: str | None = None):
    """The lowering a one-device run of model_cfg takes (jaxgpt/lowering/), with model.ops=`ops` if given."""
    import dataclasses

    from jaxgpt.lowering import choose
    model_cfg = model_cfg if ops is None else dataclasses.replace(model_cfg, ops=ops)
    return choose(model_cfg, make_mesh({"dp": 1}, jax.devices()[:1]))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def xla_flags(devices: int | None) -> str:
    """The test session's XLA_FLAGS (tests/conftest.py) for a subprocess with `devices` CPU devices
    (None: no device count, for launch_multihost.sh, which adds its own)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return " ".join(kept + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def run_cli(*args: str, module: str = "jaxgpt.train", timeout: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m module args` in a subprocess with the test's 8 fake devices (and `env` added)."""
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def main_in_process(*args: str, module: str = "jaxgpt.train") -> subprocess.CompletedProcess:
    """What `python -m module args` exits with and prints, run through the command's main() in this
    process (its compiled programs shared with the test's; no interpreter start or import, ~2.5 s on
    2 cores). What a real process adds (the allocator's re-exec, signals, C++ lines on fd 2) is
    tested with run_cli."""
    import contextlib
    import importlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            command = importlib.import_module(module)
            main = getattr(command, "main", None) or importlib.import_module(f"{module}.cli").main  # jaxgpt.hf, jaxgpt.evaluate
            code = main(list(args))
        except SystemExit as e:  # argparse's own usage errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def restore_run(run_dir: Path, cfg, devices=None):
    """(the run's newest checkpoint restored under cfg's mesh over `devices` (default all 8), the Setup used)."""
    mesh = make_mesh(validate(cfg, len(devices) if devices else 8), devices)
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        ckpt = Checkpointer(Path(run_dir) / "checkpoints", cfg.checkpoint)
        restored = ckpt.restore_latest(abstract_state(cfg, setup))
        ckpt.close()
    return restored, setup


def packed_batch(seed: int = 0) -> np.ndarray:
    """16 windows of 33 tokens of the tiny model's vocabulary with documents of random lengths (some
    windows hold one), each begun by its <|endoftext|> (TINY_EOT)."""
    rng = np.random.default_rng(seed)
    batch = rng.integers(0, TINY_EOT, (16, 33)).astype(np.int32)
    batch[rng.random((16, 33)) < 0.1] = TINY_EOT
    return batch


def step_metrics(cfg, devices, steps: int = 2) -> list[dict]:
    """The metrics of `steps` train steps of cfg on `devices`, from fresh init, on packed_batch(0), (1), ..."""
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state, step = init_state(cfg, setup), make_train_step(cfg, mesh, setup)
        out = []
        for seed in range(steps):
            state, metrics = step(state, packed_batch(seed))
            out.append(jax.device_get(metrics))
    return out


def script_module(name: str):
    """scripts/NAME.py, imported from its file (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- tokenizers built here (tokenizers' BPE trainer on the bundled text: no download) ------------------

QWEN_TEMPLATE = (  # ChatML as Qwen3 writes it: the last assistant turn (and, not thinking, the prompt) with an empty think block
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role in ['system', 'user', 'assistant'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('Unknown role: ' + message.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
UNICODE = ["héllo wörld ☃ 🤖 日本語 עברית Ελληνικά", "naïve café — “quotes” ‘and’ … ellipsis", "e\u0301 \u00a0 \u3000 ß"]


def _bpe_corpus() -> list[str]:
    text = (REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt").read_text()[:200_000]
    return [text[i:i + 2000] for i in range(0, len(text), 2000)] + UNICODE * 20


def qwen_tokenizer(directory: Path, merges: int = 128) -> Path:
    """A Qwen-shaped tokenizer.json (byte-level BPE, 256 + `merges` tokens, then <|endoftext|>,
    <|im_start|>, <|im_end|> as Qwen numbers them after its vocabulary) with a tokenizer_config.json
    holding a Qwen3-style chat template; returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_bpe_corpus(), trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": QWEN_TEMPLATE}))
    return directory


def llama3_tokenizer(path: Path, merges: int = 128) -> Path:
    """A Llama-3-shaped tiktoken BPE file (base64 token, rank), its ranks a BPE trained with
    Llama 3's split pattern; jaxgpt adds Llama 3's 256 special tokens after them. Returns the file."""
    import base64

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from jaxgpt.tokenizer import LLAMA3_PATTERN, byte_to_char

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_bpe_corpus(), trainer)
    to_byte = {c: b for b, c in enumerate(byte_to_char())}
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(bytes(to_byte[c] for c in s)).decode()} {i}\n" for s, i in vocab))
    return path
