"""Config layering and validation, in-process (the CLI's error lines are tested in test_cli.py)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxgpt.config import CONFIG_DIR, Config, Range, all_keys, help_text, load_config, mesh_shape, validate
from jaxgpt.errors import UserError


def test_layers_defaults_yaml_overrides():
    cfg = load_config("gpt2-124m", ["train.steps=7", "optimizer.lr=1e-3"], mesh="fsdp=4,tp=2")
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.seq_len) == (12, 768, 1024)  # from YAML
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 1e-3  # from the command line
    assert (cfg.mesh.dp, cfg.mesh.fsdp, cfg.mesh.tp) == (1, 4, 2)  # unnamed axes are 1
    assert cfg.data == Config().data  # untouched sections keep their defaults


def test_no_config_is_the_shakespeare_default():
    assert load_config() == load_config("shakespeare") == load_config(str(CONFIG_DIR / "shakespeare.yaml"))


@pytest.mark.parametrize("override, message", [
    ("model.n_layr=3", "did you mean 'model.n_layer'"),
    ("trian.steps=3", "did you mean 'train.steps'"),
    ("train.lr=3e-4", "did you mean 'optimizer.lr'"),  # the name, in another section
    ("train.learning_rate=3e-4", "did you mean 'optimizer.lr'"),  # what nanoGPT calls it
    ("train.max_iters=100", "did you mean 'train.steps'"),
    ("model.block_size=256", "did you mean 'model.seq_len'"),
    ("checkpoint.evry=5", "did you mean 'checkpoint.every'"),  # its own section's, not logging.every
    ("model.n_layer=three", "wants an int"),
    ("model.dtype=bf16", "did you mean 'bfloat16'"),
    ("train.steps", "section.key=value"),
    ("model.n_layer=[", r"wants an int, got '\[' \(not a YAML value"),  # was yaml's traceback
    ("model.n_layer=*a", "wants an int, got '\\*a'"),
    ("model.n_layer=!!python/object/apply:os.system [ls]", "wants an int"),
    ("train.steps=1:30", "wants an int, got '1:30'"),  # YAML 1.1 read 90
    ("model.n_layer=0x10", "wants an int, got '0x10'"),
    ("train.steps=" + "9" * 5000, "wants an int"),  # Python's 4,300-digit limit: was a ValueError traceback
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


def test_mesh_resolution():
    assert mesh_shape(load_config(mesh="dp=2,fsdp=-1").mesh, 8) == {"pp": 1, "dp": 2, "fsdp": 4, "cp": 1, "ep": 1, "tp": 1}
    assert mesh_shape(load_config().mesh, 8) == {"pp": 1, "dp": 8, "fsdp": 1, "cp": 1, "ep": 1, "tp": 1}  # default: all devices dp
    for spec, message in [("dp=3", "has 3 devices but 8"), ("dp=-1,tp=-1", "only one axis"),
                          ("dp=3,fsdp=-1", "does not divide"), ("dq=8", "did you mean 'dp'")]:
        with pytest.raises(UserError, match=message):
            validate(load_config(mesh=spec), 8)


@pytest.mark.parametrize("overrides, mesh, message", [
    (["train.batch_size=12"], "dp=8", "does not split over dp x fsdp x ep = 8"),
    (["train.grad_accum=3"], "dp=8", "does not divide train.batch_size"),
    (["train.batch_size=1073741824"], "dp=8", "137,438,953,472 tokens per step must be below 2"),  # hung reading eval
    (["model.n_head=3", "model.n_embd=48"], "dp=4,tp=2", "not divisible by the tp axis"),
    (["model.n_head=5"], "dp=8", "does not divide model.n_embd"),
    (["model.loss_chunk=48"], "dp=8", "model.loss_chunk=48 does not divide model.seq_len=128"),
    (["model.vocab_size=1000"], "dp=8", "raise model.vocab_size to at least 50257"),
    (["train.steps=0"], "dp=8", "train.steps must be > 0, got 0"),
])
def test_impossible_combinations(overrides, mesh, message):
    with pytest.raises(UserError, match=message):
        validate(load_config(None, overrides, mesh), 8, data_vocab_size=50257)


def test_help_lists_every_key_with_default():
    text = help_text()
    for key in ["model.n_layer", "train.grad_accum", "mesh.tp", "optimizer.warmup_steps", "data.path"]:
        assert key in text
    assert "model.n_layer              = 4" in text


@pytest.mark.parametrize("override, message", [
    ("optimizer.beta1=1.5", "optimizer.beta1 must be in [0, 1), got 1.5"),
    ("optimizer.beta2=1", "optimizer.beta2 must be in [0, 1), got 1.0"),
    ("optimizer.lr=inf", "optimizer.lr must be a finite number > 0, got inf"),
    ("optimizer.lr=.nan", "optimizer.lr must be a finite number > 0, got nan"),
    ("optimizer.lr=0", "optimizer.lr must be > 0, got 0.0"),
    ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio must be in [0, 1], got 1.5"),
    ("optimizer.grad_clip=-1", "optimizer.grad_clip must be >= 0, got -1.0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0, got -0.1"),
    ("optimizer.eps=0", "optimizer.eps must be > 0, got 0.0"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps must be >= 0, got -1"),
    ("train.seed=-1", "train.seed must be in [0, 4294967295], got -1"),
    ("train.eval_every=-5", "train.eval_every must be >= 0, got -5"),
    ("mesh.tp=0", "mesh.tp must be -1 or >= 1, got 0"),
    ("checkpoint.keep=0", "checkpoint.keep must be > 0, got 0"),
    ("data.prefetch=-1", "data.prefetch must be >= 0, got -1"),
    ("logging.every=0", "logging.every must be > 0, got 0"),
    ("train.steps=" + "9" * 400, "train.steps must be below 2**31, got " + "9" * 400),
])
def test_each_number_out_of_range_names_its_key_and_value(override, message):
    with pytest.raises(UserError) as e:
        load_config(None, [override])
    assert str(e.value) == message


def test_ranges_hold_for_yaml_and_for_configs_built_in_code(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: .inf\n")
    with pytest.raises(UserError, match=r"^optimizer.lr must be a finite number > 0, got inf$"):
        load_config(str(path))
    cfg = Config()
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, beta1=1.5))
    with pytest.raises(UserError, match=r"^optimizer.beta1 must be in \[0, 1\), got 1.5$"):
        validate(cfg, 8)


def test_every_numeric_key_has_a_range_shown_by_help():
    text = help_text()
    for key, f in all_keys().items():
        if type(f.default) in (int, float):
            assert f.metadata["range"] != Range(), f"{key} has no range: give its _f(...) a range="
            assert f.default in f.metadata["range"], key
            line = next(line for line in text.splitlines() if line.split()[:1] == [key])
            assert f"({f.metadata['range']})" in line, line


@pytest.mark.parametrize("content, message", [
    (b"model:\n  n_layer: 2\n  # \xff\xfe\n", r"is not UTF-8 text \(byte 0xff at offset 24\)"),
    (b"- model\n- train\n", r"must hold sections such as 'model:'"),
    (b"model: [1, 2\n", r"is not valid YAML"),
    # PyYAML would keep the second section or key silently, dropping the first
    (b"train:\n  steps: 5\nmodel:\n  n_layer: 2\ntrain:\n  seed: 3\n", r"not valid YAML: key 'train' is given twice \(line 5\)"),
    (b"train:\n  steps: 5\n  steps: 6\n", r"not valid YAML: key 'steps' is given twice \(line 3\)"),
    (b"train: 5\n", r"section 'train' in .* must map keys to values$"),  # no 'did you mean' itself
])
def test_bad_config_files_are_one_sentence(tmp_path, content, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_config(str(path))
    with pytest.raises(UserError, match=r"config file .* is a directory, not a file"):
        load_config(str(tmp_path))


def test_numbers_read_as_yaml_1_2_in_files_and_overrides(tmp_path):
    """YAML 1.1 (PyYAML's default) read 010 as octal 8 and 1:30 as base-60 90, silently; '1e-3' as text."""
    cfg = load_config(None, ["train.steps=010", "optimizer.lr=1e-3", "train.batch_size=1_6"])
    assert (cfg.train.steps, cfg.optimizer.lr, cfg.train.batch_size) == (10, 0.001, 16)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 010\noptimizer:\n  lr: 6e-4\nlogging:\n  profile_steps: 10:12\n")
    cfg = load_config(str(path))
    assert (cfg.train.steps, cfg.optimizer.lr, cfg.logging.profile_steps) == (10, 6e-4, "10:12")


@pytest.mark.parametrize("text, message", [
    ("? [a, b]\n: 1\n", "a list cannot be a key"),  # was TypeError: unhashable type
    ("model: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply"),  # was a RecursionError traceback
    ("model:\n  n_layer: " + "9" * 5000 + "\n", "has 5,000 characters"),
    ("eval:\n  tasks: {a: null}\n", "'eval.tasks' holds an empty \\(null\\) entry"),  # was "task file None does not exist"
    ("data:\n  mix: [null]\n", "'data.mix' holds an empty \\(null\\) entry"),
])
def test_malformed_yaml_files_are_one_error(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_config(str(path))


def test_an_alias_bomb_is_reported_briefly(tmp_path):
    """Nine levels of aliases: a few hundred bytes that nest into 10**9 items; the error quoted the
    whole value (2.1 GB, 63 s)."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text(f"model:\n  n_layer: [{', '.join(levels)}]\n")
    with pytest.raises(UserError, match="wants an int") as e:
        load_config(str(path))
    assert len(str(e.value)) < 1000


def test_yaml_merge_keys_still_override():
    """`<<: *anchor` then a key of the anchor's: an override, not a key given twice."""
    from jaxgpt.files import load_yaml
    assert load_yaml("a: &x {b: 1, d: 0}\nc:\n  <<: *x\n  d: 2\n") == {"a": {"b": 1, "d": 0}, "c": {"b": 1, "d": 2}}


def test_llama_8b_has_llama_3_8b_shape_and_its_layouts_validate():
    """configs/llama-8b.yaml: Llama-3-8B's shape (8.03B parameters with its 128,256-token
    vocabulary, 7.39B with GPT-2's), for 8 GPUs under fsdp=8 and, 4 layers of it, for one. Its
    compiles for H100 are too long for the suite: docs/benchmarks.md has the plan commands."""
    from jaxgpt.model.gpt import param_count
    cfg = load_config("llama-8b", [], "fsdp=8")
    assert validate(cfg, 8) == {"pp": 1, "dp": 1, "fsdp": 8, "cp": 1, "ep": 1, "tp": 1}
    llama3 = dataclasses.replace(cfg.model, vocab_size=128256)
    assert round(param_count(llama3) / 1e9, 2) == 8.03 and round(param_count(cfg.model) / 1e9, 2) == 7.39
    assert validate(load_config("llama-8b", ["model.n_layer=4"]), 1)["fsdp"] == 1
