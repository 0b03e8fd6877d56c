"""Sampling: KV-cached decoding gives the tokens of full recomputation; filters; the CLI."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import main_in_process, run_cli, tiny_config

from jaxgpt.model import GPT
from jaxgpt.sample import filter_logits, generate
from jaxgpt.train import train


def _random_model(cfg):
    """A tiny model with weights far from init, so the argmax is not a near-tie everywhere."""
    model = GPT(cfg.model, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape), params)
    return graphdef, params


def test_cached_decoding_matches_full_recomputation():
    cfg = tiny_config()
    graphdef, params = _random_model(cfg)
    prompt_BT = np.asarray(jax.random.randint(jax.random.key(1), (3, 5), 0, cfg.model.vocab_size), np.int32)
    cached = np.stack(list(generate(graphdef, params, cfg, prompt_BT, 20, temperature=0)), axis=1)

    # no cache: the whole sequence again for every new token, the model's last position read. Run
    # at one shape (the context, zeros after the tokens, which causal attention never lets an
    # earlier position see): one compile instead of one per length.
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))

    def forward(p, t_BT):
        last = t_BT.shape[1] - 1
        return logits(p, np.pad(t_BT, ((0, 0), (0, cfg.model.seq_len - t_BT.shape[1]))))[:, last]

    seq = prompt_BT
    for _ in range(20):
        seq = np.concatenate([seq, np.asarray(jnp.argmax(forward(params, seq), -1))[:, None]], axis=1)
    np.testing.assert_array_equal(cached, seq[:, 5:])

    # past the context (32): cropped to its newest half whenever it is full, positions from 0 again
    cached = np.stack(list(generate(graphdef, params, cfg, prompt_BT, 70, temperature=0)), axis=1)
    seq, start = prompt_BT, 0
    for _ in range(70):
        if seq.shape[1] - start > cfg.model.seq_len:
            start = seq.shape[1] - cfg.model.seq_len // 2
        next_B = np.asarray(jnp.argmax(forward(params, seq[:, start:]), -1))
        seq = np.concatenate([seq, next_B[:, None]], axis=1)
    np.testing.assert_array_equal(cached, seq[:, 5:])


def test_sampling_is_seeded():
    cfg = tiny_config()
    graphdef, params = _random_model(cfg)
    prompt_BT = np.zeros((2, 3), np.int32)
    draw = lambda seed: np.stack(list(generate(graphdef, params, cfg, prompt_BT, 8, temperature=1.0,  # noqa: E731
                                               top_k=50, seed=seed)), axis=1)
    assert np.array_equal(draw(0), draw(0)) and not np.array_equal(draw(0), draw(1))


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isfinite(np.asarray(filter_logits(logits, 1.0, 2, 1.0))).tolist() == [[True, True, False, False]]
    # nucleus 0.7: 0.5 alone is not enough, 0.5 + 0.3 is
    assert np.isfinite(np.asarray(filter_logits(logits, 1.0, 0, 0.7))).tolist() == [[True, True, False, False]]
    assert np.isfinite(np.asarray(filter_logits(logits, 1.0, 0, 0.4))).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("temperature", [1e38, 1e308])
def test_a_huge_temperature_samples_uniformly_and_never_a_masked_id(temperature):
    """Past fp32's range 1 / temperature underflows to 0 and -inf * 0 was NaN: a masked (padding)
    id came out of the draw and decoding it raised KeyError. Now the real ids stay finite and equal,
    the masked one -inf, and no draw picks it."""
    import jax

    logits = jnp.asarray([[2.0, -3.0, 0.5, -jnp.inf]])
    out = np.asarray(jax.jit(filter_logits, static_argnums=(1, 2, 3))(logits, temperature, 0, 1.0))
    assert np.isfinite(out[0, :3]).all() and np.ptp(out[0, :3]) < 1e-20 and out[0, 3] == -np.inf
    draws = jax.vmap(lambda k: jax.random.categorical(k, jnp.asarray(out)[0]))(jax.random.split(jax.random.key(0), 300))
    assert set(np.asarray(draws).tolist()) == {0, 1, 2}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, shakespeare_dir):
    run_dir = tmp_path_factory.mktemp("sample-run")
    train(tiny_config("train.steps=3", mesh="dp=8"), run_dir)
    return run_dir


def test_sample_cli_streams_text(trained_run):
    proc = run_cli(str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--mesh", "fsdp=2,tp=4",
                   module="jaxgpt.sample")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:\n")


def test_sample_cli_bad_input(trained_run, capsys, monkeypatch):
    """In-process through main(): exit 2 and one error line before any other output (no header, no prompt)."""
    from jaxgpt import plan
    from jaxgpt.sample import main

    monkeypatch.setattr(plan, "host_memory_available", lambda: 24 * 2**30)  # as if every host said so

    for args, fragment in [
        (["--prompt", " ".join("abcdefghijklmnopqrstuvwxyz" * 2)], "the prompt (58 tokens) is longer than the model's "
                                                                    "context of 32 tokens"),
        (["--mesh", "tp=3", "--max-new-tokens", "4"], "has 3 devices but 8"),
        (["--mesh", "pp=2,tp=4", "--max-new-tokens", "4"], "sampling does not pipeline (pp=2)"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--prompt", "ab\udcffcd"], "--prompt is not UTF-8 text"),  # a byte 0xff on the command line (was taken)
        (["--num-samples", "10000000", "--max-new-tokens", "4"], "sampling needs about"),  # > 1 TiB of KV cache
    ]:
        code = main([str(trained_run), *args])
        out, err = capsys.readouterr()
        assert (code, out) == (2, "") and err.startswith("error: ") and err.count("\n") == 1, (args, err)
        assert fragment in err, (args, err)


def test_sample_cli_missing_run(tmp_path):
    proc = main_in_process(str(tmp_path / "nothing"), module="jaxgpt.sample")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
