"""Issue 22: val_bpb and multiple-choice tasks, during training and from `python -m jaxgpt.evaluate`.

Exact arithmetic (a hand-built unigram model with a known answer, and the scorer against log-softmax
of the model's whole logits), bits per byte against the bytes of the decoded text, lm-eval-harness's
request construction, one-line refusals of bad task files, a run that logs both at every evaluation
and resumes with identical rows, and the same scores from transformers on the run's HF export
(where torch is installed)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import GPT2_VOCAB, read_metrics, run_cli, tiny_config

from jaxgpt.evaluate import cli as eval_cli
from jaxgpt.config import validate
from jaxgpt.metrics import timing_key
from jaxgpt.errors import UserError
from jaxgpt.evaluate.score import Scorer, accuracies, buckets
from jaxgpt.evaluate.tasks import encode_pair, load_task, parse_spec, preprocess, read_examples
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.sample import shard_params
from jaxgpt.step import abstract_model, make_eval_step, make_setup
from jaxgpt.tokenizer import EOT_ID, gpt2_encoding, token_bytes
from jaxgpt.train import train

GENERIC = [{"context": "ROMEO: What light through yonder window", "choices": ["breaks.", "is a cat", "Juliet"],
            "label": 0},
           {"context": "Question: 2 + 2 = ?\nAnswer: ", "choices": ["4", "five", "twenty-two"], "label": "0"},
           {"context": "", "choices": ["To be, or not to be", "Thou art"], "label": 1},
           {"context": "First Citizen:\nBefore we proceed any further, hear me speak.", "choices": [
               "Speak, speak.", "Resolved. resolved.", "We know't, we know't.", "Nay, but speak not maliciously."],
            "label": 3}]
HELLASWAG = [{"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.",
              "ctx_b": "he", "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain",
              "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                          "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": 3},
             {"ind": 92, "activity_label": "Home and Garden", "ctx_a": "[header] How to clean a hardwood floor "
              "[title] Sweep the floor.", "ctx_b": "use a broom", "endings": [
                  "and a dustpan. [step] Start in one corner.", "to brush the  ceiling.",
                  "[substeps] while  singing.", "on the cat."], "label": 0}]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, shakespeare_dir):
    """A tiny run (4 steps, evaluations at 0, 2, 4, checkpoints at 2 and 4) scoring both formats."""
    d = tmp_path_factory.mktemp("eval")
    spec = f"mc={_jsonl(d / 'mc.jsonl', GENERIC)},hs={_jsonl(d / 'hs.jsonl', HELLASWAG)}"
    cfg = tiny_config("train.steps=4", "train.eval_every=2", "checkpoint.every=2", "train.eval_batches=1",
                      f"eval.tasks={spec}", "checkpoint.async_save=false", *GPT2_VOCAB)  # bpb of GPT-2's tokens
    train(cfg, d / "run")
    return d, cfg, spec


def test_hellaswag_and_generic_requests_follow_lm_eval_harness(tmp_path):
    examples = read_examples(_jsonl(tmp_path / "hs.jsonl", HELLASWAG))
    assert examples[0] == ("Roof shingle removal: A man is sitting on a roof. He",
                           ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                            "is holding a rubik's cube.", "starts pulling up roofing on a roof."], 3)
    # stripped first, then " [title]" -> ". ", every [...] dropped, double spaces single (so a leading
    # "[substeps] " leaves a space, as in lm-eval-harness)
    assert examples[1][0] == "Home and Garden: How to clean a hardwood floor. Sweep the floor. Use a broom"
    assert examples[1][1][:3] == ["and a dustpan. Start in one corner.", "to brush the ceiling.", " while singing."]
    assert preprocess("  a [title] b [x]c  d ") == "a. b c d"
    enc = gpt2_encoding()
    # trailing whitespace moves into the continuation; the continuation is cut from the joint encoding
    ctx, cont = encode_pair("Answer: ", " 4")
    assert ctx == enc.encode("Answer:") and cont == enc.encode("Answer:  4")[len(ctx):]
    assert encode_pair("", " To be") == ([EOT_ID], enc.encode(" To be"))
    task = load_task("t", _jsonl(tmp_path / "mc.jsonl", GENERIC), seq_len=8)
    assert task.labels.tolist() == [0, 0, 1, 3] and task.chars[0] == [7, 8, 6]
    bom = tmp_path / "bom.jsonl"  # a Windows editor's byte-order mark before the first line
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "mc.jsonl").read_bytes())
    assert read_examples(bom) == read_examples(tmp_path / "mc.jsonl")
    full = encode_pair(GENERIC[3]["context"], " Nay, but speak not maliciously.")
    assert task.tokens[3][3].tolist() == (full[0] + full[1])[-9:]  # cut on the left to T+1 tokens
    assert task.continuation[3][3] == len(full[1]) == 8


@pytest.mark.parametrize("rows, message", [
    (["{not json"], r"line 1 is not valid JSON"),
    ([{"context": "a", "label": 0}], r"line 1 lacks the key 'choices'"),
    ([GENERIC[0], {"context": "a", "choices": ["x", "y"], "label": 2}], r"line 2: label 2 is out of range for 2"),
    ([{"context": "a", "choices": [], "label": 0}], r"line 1: 'choices' is empty"),
    ([{"context": "a", "choices": ["x", " "], "label": 0}], r"line 1: choices\[1\] is empty"),
    ([{**HELLASWAG[0], "endings": "abc"}], r"line 1: 'endings' is a string"),
    ([{k: v for k, v in HELLASWAG[0].items() if k != "label"}], r"line 1 lacks the key 'label'"),
    ([""], r"holds no examples"),
    (None, r"task file .* does not exist"),
])
def test_bad_task_files_are_one_line_and_exit_2(run, rows, message, tmp_path, capsys):
    d, _, _ = run
    path = tmp_path / "bad.jsonl" if rows is None else _jsonl(tmp_path / "bad.jsonl", rows)
    assert eval_cli.main([str(d / "run"), "--task", f"bad={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: task file ") and str(path) in err[0], err
    assert re.search(message, err[0]), err


def test_a_choice_too_long_for_the_context_names_its_line(tmp_path):
    """Issue 39: the errors found once an example is tokenized name its file and line (blank lines
    counted, as an editor numbers them), as the others do, not the example's index (was "example 3")."""
    long = {"context": "Say it:", "choices": ["x", "word " * 200], "label": 0}
    path = _jsonl(tmp_path / "mc.jsonl", [GENERIC[0], GENERIC[1], "", long])
    with pytest.raises(UserError) as e:
        load_task("mc", path, seq_len=32)
    assert str(e.value) == f"task file {path}: line 4: choice 1 is 201 tokens, more than the model's context of 32"


def test_task_config_is_checked_before_compiling():
    def refused(*overrides, mesh=None):
        with pytest.raises(UserError) as e:
            validate(tiny_config(*overrides, mesh=mesh), 8)
        return str(e.value)

    assert "train.eval_every=0" in refused("eval.tasks=a=x.jsonl")
    assert "eval.task_every=30 is not a multiple of train.eval_every=20" in refused(
        "eval.tasks=a=x.jsonl", "train.eval_every=20", "eval.task_every=30")
    assert "does not pipeline" in refused("eval.tasks=a=x.jsonl", "train.eval_every=2", mesh="pp=2,dp=4")
    assert "given twice" in refused("eval.tasks=a=x.jsonl,a=y.jsonl", "train.eval_every=2")
    assert "only letters" in refused("eval.tasks=a/b=x.jsonl", "train.eval_every=2")
    assert "NAME=PATH" in refused("eval.tasks==x.jsonl", "train.eval_every=2")
    assert "give NAME=PATH" in refused("eval.tasks=my task.jsonl", "train.eval_every=2")
    assert "name each task (NAME=PATH)" in refused("eval.tasks=a/val.jsonl,b/val.jsonl", "train.eval_every=2")
    assert "the form is NAME=PATH or PATH" in refused("eval.tasks=runs/lr=3e-4/val.jsonl", "train.eval_every=2")
    assert parse_spec("data/hellaswag_val.jsonl, mc=m.jsonl") == [("hellaswag_val", Path("data/hellaswag_val.jsonl")),
                                                                 ("mc", Path("m.jsonl"))]  # a PATH alone: its stem
    from jaxgpt.config import _apply, Config
    cfg = _apply(Config(), {"eval.tasks": {"hs": "h.jsonl", "mc": "m.jsonl"}}, "a YAML file")  # YAML mapping
    assert parse_spec(cfg.eval.tasks) == [("hs", Path("h.jsonl")), ("mc", Path("m.jsonl"))]


def test_accuracy_and_length_normalisation_as_lm_eval_harness():
    loglik = [np.array([-10.0, -12.0]), np.array([-3.0, -3.0]), np.array([-8.0, -9.0])]
    chars = [[5, 20], [4, 4], [4, 12]]
    # argmax: 0, 0 (first of a tie), 0; per character: -2 vs -0.6 -> 1, tie -> 0, -2 vs -0.75 -> 1
    assert accuracies(loglik, chars, np.array([0, 0, 1])) == (2 / 3, 2 / 3)
    assert accuracies(loglik, chars, np.array([1, 0, 1])) == (1 / 3, 1.0)
    assert buckets(128) == [16, 32, 64, 128] and buckets(100) == [16, 32, 64, 100] and buckets(8) == [8]


def _random_params(cfg, seed: int) -> dict:
    """Normal(0, 0.2) parameters of cfg's shapes, made on the host (no compile)."""
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(abstract_model(cfg)[1])
    return jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(np.float32), shapes)


def _unigram_model(cfg, logits_V: np.ndarray) -> dict:
    """Parameters under which every position predicts the same distribution softmax(logits_V): the
    final LayerNorm's scale is 0 and its bias e_0, so the head sees e_0 and the logits are wte[:, 0]."""
    params = _random_params(cfg, 0)
    params["ln_f"]["scale"] = np.zeros_like(params["ln_f"]["scale"])
    params["ln_f"]["bias"] = np.eye(1, cfg.model.n_embd, dtype=np.float32)[0]
    params["wte"][:, 0] = 0.0
    params["wte"][: len(logits_V), 0] = logits_V
    return params


def test_a_model_made_to_prefer_an_ending_scores_it_exactly(tmp_path):
    cfg = tiny_config(*GPT2_VOCAB)
    enc = gpt2_encoding()
    favoured = enc.encode(" Juliet")
    logits_V = np.zeros(cfg.model.vocab_size, np.float32)
    logits_V[favoured] = 6.0
    logp_V = logits_V.astype(np.float64) - np.log(np.exp(logits_V.astype(np.float64)).sum())
    params, mesh = shard_params(_unigram_model(cfg, logits_V), cfg, "dp=2,fsdp=2,tp=2")
    rows = [{"context": "But soft, who comes here?", "choices": ["Juliet", "is a cat", "Juliet Juliet"],
             "label": 0},
            {"context": "Then", "choices": ["the nurse", "Juliet and her nurse came in from the garden"],
             "label": 1}]
    task = load_task("t", _jsonl(tmp_path / "t.jsonl", rows), cfg.model.seq_len)
    scores = Scorer(abstract_model(cfg)[0], cfg.model, mesh, batch_rows=4).score(params, task)
    for e, example in enumerate(task.tokens):
        want = [sum(logp_V[t] for t in seq[-n:]) for seq, n in zip(example, task.continuation[e], strict=True)]
        np.testing.assert_allclose(scores.loglik[e], want, rtol=1e-6)
    # log p = -4.83 for " Juliet" (one token), -10.83 for any other token. Example 1: " Juliet" has the
    # highest total (acc right), " Juliet Juliet" the highest per character (-0.74 vs -0.81: acc_norm
    # wrong). Example 2: " the nurse" (2 tokens, -21.7) beats the 9-token ending (-91.5) in total
    # (acc wrong) but not per character (-2.41 vs -2.08: acc_norm right).
    assert [int(np.argmax(ll)) for ll in scores.loglik] == [0, 0]
    assert [int(np.argmax(ll / np.asarray(c))) for ll, c in zip(scores.loglik, task.chars)] == [2, 1]
    assert (scores.acc, scores.acc_norm) == (0.5, 0.5)


@jax.jit(static_argnums=0)
def _log_softmax(graphdef, params, tokens_BT):
    return jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens_BT), axis=-1)


def test_scores_equal_log_softmax_of_the_whole_logits_in_every_bucket():
    cfg = tiny_config()
    graphdef = abstract_model(cfg)[0]
    params = _random_params(cfg, 1)
    rng = np.random.default_rng(0)
    lengths = [3, 17, 33, 9, 16, 25, 2, 33, 12, 30, 5, 18]  # inputs of 2..32 positions: buckets 16 and 32
    sequences = [rng.integers(0, cfg.model.vocab_size, n).astype(np.int32) for n in lengths]
    continuation = [min(n - 1, k) for n, k in zip(lengths, rng.integers(1, 6, len(lengths)), strict=True)]
    sharded, mesh = shard_params(params, cfg, "dp=2,fsdp=2,tp=2")
    scorer = Scorer(graphdef, cfg.model, mesh, batch_rows=3)  # 4 rows per batch: several batches, padded
    got = scorer.loglik(sharded, sequences, continuation)
    inputs_BT = np.zeros((len(sequences), cfg.model.seq_len), np.int32)  # right padding: causal, unseen
    for i, seq in enumerate(sequences):
        inputs_BT[i, :len(seq) - 1] = seq[:-1]
    logp_BTV = np.asarray(_log_softmax(graphdef, params, inputs_BT), np.float64)  # whole logits, unchunked
    for i, (seq, n, score) in enumerate(zip(sequences, continuation, got, strict=True)):
        want = sum(logp_BTV[i, t, seq[t + 1]] for t in range(len(seq) - 1 - n, len(seq) - 1))
        np.testing.assert_allclose(score, want, rtol=2e-6)
    assert scorer.step._cache_size() == 2  # one program per bucket, none per example


def test_val_bpb_counts_the_bytes_of_the_text_the_labels_decode_to(shakespeare_dir):
    cfg = tiny_config(*GPT2_VOCAB)
    enc = gpt2_encoding()
    text = "Héllo, wörld! 日本語 ROMEO: «soft»<|endoftext|>A new document 🙂 " * 3
    batch_BT1 = np.resize(np.asarray(enc.encode(text, allowed_special="all"), np.int32), (16, 33))
    labels = batch_BT1[:, 1:]
    assert (labels == EOT_ID).any()
    text_bytes = sum(len(enc.decode_bytes([t])) for t in labels.ravel() if t != EOT_ID)
    assert token_bytes(cfg.model.padded_vocab)[labels].sum() == text_bytes
    mesh = make_mesh(validate(cfg, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        params = jax.device_put(_random_params(cfg, 2), setup.shardings.params)
        out = jax.device_get(make_eval_step(cfg, mesh, setup)(params, batch_BT1))
    logp_BTV = np.asarray(_log_softmax(setup.graphdef, jax.device_get(params), batch_BT1[:, :-1]))
    nats_BT = -np.take_along_axis(logp_BTV, labels[..., None], axis=-1)[..., 0].astype(np.float64)
    assert int(out["text_bytes"]) == text_bytes
    np.testing.assert_allclose(out["text_nats"], nats_BT[labels != EOT_ID].sum(), rtol=1e-6)
    np.testing.assert_allclose(out["loss"], nats_BT.mean(), rtol=1e-6)


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not timing_key(k)} for r in read_metrics(run_dir)]


def test_run_logs_bpb_and_tasks_at_every_eval_and_resumes_with_identical_rows(run):
    d, cfg, _ = run
    evals = [r for r in read_metrics(d / "run") if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert set(r) == {"step", "val_loss", "val_bpb", "task/mc/acc", "task/mc/acc_norm", "task/hs/acc",
                          "task/hs/acc_norm"}
        assert 2.5 < r["val_loss"] / math.log(2) / r["val_bpb"] < 4.5  # bytes per token of English text
    report = (d / "run" / "report.md").read_text()
    assert "| task/mc/acc" not in report and "| mc/acc_norm |" in report and (d / "run" / "tasks.png").is_file()
    # Killed after checkpoint 2 was committed, mid-way through step 4's rows; the re-run resumes from 2.
    killed = d / "killed"
    shutil.copytree(d / "run", killed)
    shutil.rmtree(killed / "checkpoints" / "4")
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    (killed / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    train(cfg, killed)
    assert _rows(killed) == _rows(d / "run")


def test_eval_cli_gives_the_training_rows_numbers(run, capsys):
    d, _, spec = run
    args = [str(d / "run"), "--json", "--batch-size", "16"]  # the training's mesh (dp=8) and rows
    assert eval_cli.main([*args, *(a for name_path in spec.split(",") for a in ("--task", name_path))]) == 0
    got = json.loads(capsys.readouterr().out)
    last = [r for r in read_metrics(d / "run") if "val_loss" in r][-1]
    assert got == {"step": 4, "task/mc/examples": 4, "task/hs/examples": 2,
                   **{k: v for k, v in last.items() if k.startswith("task/")}}


def test_the_command_is_python_m_jaxgpt_evaluate(tmp_path):
    """One name for the CLI and its logic (issue 39): the package runs as a module; a bad option is one line."""
    proc = run_cli(str(tmp_path), "--task", "x.jsonl", "--limit", "-1", module="jaxgpt.evaluate", timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "error: --limit must be >= 0, got -1\n")


def test_transformers_on_the_hf_export_gives_the_same_scores(run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxgpt.hf import export, restore_params

    d, cfg, spec = run
    assert export(d / "run", tmp_path / "hf") == 4
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    params, _, _ = restore_params(d / "run")
    params, mesh = shard_params(params, cfg, "dp=8")
    scorer = Scorer(abstract_model(cfg)[0], cfg.model, mesh, batch_rows=8)
    for name, path in parse_spec(spec):
        ours = scorer.score(params, load_task(name, path, cfg.model.seq_len))
        theirs = []
        for context, choices, _ in read_examples(path):  # lm-eval-harness's HF model, written out
            lls = []
            for choice in choices:
                cont = " " + choice
                spaces = len(context) - len(context.rstrip())
                ctx, cont = (context[:-spaces], context[-spaces:] + cont) if spaces else (context, cont)
                ctx_ids = tok.encode(ctx) if ctx else [tok.eos_token_id]
                cont_ids = tok.encode(ctx + cont)[len(ctx_ids):] if ctx else tok.encode(cont)
                ids = (ctx_ids + cont_ids)[-(cfg.model.seq_len + 1):]
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].double(), -1).numpy()
                lls.append(sum(logp[t - 1, ids[t]] for t in range(len(ids) - len(cont_ids), len(ids))))
            theirs.append(np.asarray(lls))
        for a, b in zip(ours.loglik, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5)
        task = load_task(name, path, cfg.model.seq_len)
        assert (ours.acc, ours.acc_norm) == accuracies(theirs, task.chars, task.labels)
