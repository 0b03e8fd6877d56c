"""Config layering and validation, in-process (the CLI's error lines are tested in test_cli.py)."""

from __future__ import annotations

import pytest

from jaxgpt.config import CONFIG_DIR, Config, help_text, load_config, mesh_shape, validate
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
    ("model.n_layer=three", "wants an int"),
    ("model.dtype=bf16", "did you mean 'bfloat16'"),
    ("train.steps", "section.key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


def test_mesh_resolution():
    assert mesh_shape(load_config(mesh="dp=2,fsdp=-1").mesh, 8) == {"dp": 2, "fsdp": 4, "tp": 1}
    assert mesh_shape(load_config().mesh, 8) == {"dp": 8, "fsdp": 1, "tp": 1}  # default: all devices dp
    for spec, message in [("dp=3", "has 3 devices but 8"), ("dp=-1,tp=-1", "only one axis"),
                          ("dp=3,fsdp=-1", "does not divide"), ("dq=8", "did you mean 'dp'")]:
        with pytest.raises(UserError, match=message):
            validate(load_config(mesh=spec), 8)


@pytest.mark.parametrize("overrides, mesh, message", [
    (["train.batch_size=12"], "dp=8", "does not split over dp x fsdp = 8"),
    (["train.grad_accum=3"], "dp=8", "does not divide train.batch_size"),
    (["model.n_head=3", "model.n_embd=48"], "dp=4,tp=2", "not divisible by the tp axis"),
    (["model.n_head=5"], "dp=8", "does not divide model.n_embd"),
    (["model.vocab_size=1000"], "dp=8", "raise model.vocab_size to at least 50257"),
    (["train.steps=0"], "dp=8", "train.steps must be positive"),
])
def test_impossible_combinations(overrides, mesh, message):
    with pytest.raises(UserError, match=message):
        validate(load_config(None, overrides, mesh), 8, data_vocab_size=50257)


def test_help_lists_every_key_with_default():
    text = help_text()
    for key in ["model.n_layer", "train.grad_accum", "mesh.tp", "optimizer.warmup_steps", "data.path"]:
        assert key in text
    assert "model.n_layer              = 4" in text
