"""Issue 61 items 3-4: supervised fine-tuning's loss mask, proven, and fine-tuning end to end.

- A token outside an assistant turn has exactly zero gradient: its head features get none, and moving
  them leaves the loss and every gradient bit for bit the same.
- Packed conversations score as each alone (document masking, positions restarting; fp32).
- The masked loss of every layout family (dp/fsdp/tp, pp with micro-batches, cp and ep) is one
  device's, to the tolerance the layout tests use (tests/test_parallel.py, test_documents.py).
- A Qwen3-shaped model with its own tokenizer fine-tunes on chat data, answers `sample --chat` in its
  template and stops at its end-of-turn token, and exports a directory whose AutoTokenizer renders
  the same chat ids (with torch, by hand: transformers' greedy reply is ours).
"""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import lowering, qwen_tokenizer, read_metrics, tiny_config
from test_hf import _perturbed
from test_qwen3 import QWEN3, QWEN3_MOE

from jaxgpt import data, sample, tokenizer
from jaxgpt.chat.bundled import conversations as bundled_conversations
from jaxgpt.chat.template import ChatTemplate
from jaxgpt.config import load_config, validate
from jaxgpt.data.conversations import Conversations, input_files
from jaxgpt.hf import export
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import (abstract_model, init_state, make_eval_step, make_setup, make_train_step, normalized_weights,
                         token_loss)
from jaxgpt.train import train

SFT = ("model.document_mask=true", "model.position_reset=true", "model.seq_len=128", "model.loss_chunk=32",
       "optimizer.warmup_steps=0")  # the first step updates: the second loss and the val loss see its gradient
LOSS_ATOL = 1e-4  # as tests/test_documents.py: layouts reorder fp32 sums only


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen") / "tok")


@pytest.fixture(scope="module")
def chats(qwen):
    """The split of 48 short generated conversations, in the Qwen-shaped template, and the template."""
    tok = tokenizer.load(str(qwen))
    template = ChatTemplate(tok)
    encoded = [template.encode(template.check(c["messages"])) for c in bundled_conversations(400, seed=3)]
    encoded = [(ids, mask) for ids, mask in encoded if len(ids) <= 64][:48]
    starts = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in encoded])])
    return Conversations(np.concatenate([i for i, _ in encoded]), np.concatenate([m for _, m in encoded]),
                         starts, tok.separator_id), template


def _batches(chats, n: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    """n fine-tuning batches (tokens [16, 129], weights [16, 128]) of packed windows."""
    windows = chats[0].windows(128)
    rows = [windows[i % len(windows)] for i in range(16 * n)]
    return [tuple(np.stack(x) for x in zip(*rows[16 * b:16 * b + 16])) for b in range(n)]


@pytest.mark.parametrize("ops", ["reference", "tuned"])  # model/ops.py's loss, and lowering/loss.py's fused one
def test_a_token_outside_an_assistant_turn_has_exactly_zero_gradient(chats, ops):
    cfg = tiny_config(*QWEN3, *SFT)
    _, params = _perturbed(cfg)
    graphdef = abstract_model(cfg, lowering(cfg.model, ops))[0]
    table = "wte" if cfg.model.tie_embeddings else "lm_head"
    tokens_BT1, weights_BT = normalized_weights(tuple(map(jnp.asarray, _batches(chats, 1)[0])))
    masked_BT = np.asarray(weights_BT) == 0
    assert 0.3 < masked_BT.mean() < 0.9  # system and user turns, headers, padding

    def loss(x_BTD, params):  # of the head alone: x is the final features
        return token_loss(nnx.merge(graphdef, params), x_BTD, tokens_BT1[:, 1:], weights_BT, jnp.float32)

    x_BTD = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens_BT1[:, :-1], jnp.float32, features_only=True))(params)
    value, (dx_BTD, dparams) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x_BTD, params)
    per_token_BT = np.abs(np.asarray(dx_BTD)).max(-1)
    assert (per_token_BT[masked_BT] == 0).all() and (per_token_BT[~masked_BT] > 0).all()
    # features moved at the masked positions: the same loss and gradients, bit for bit
    moved_BTD = x_BTD + 10.0 * masked_BT[..., None] * jax.random.normal(jax.random.key(1), x_BTD.shape)
    value2, (dx2_BTD, dparams2) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(moved_BTD, params)
    assert value2 == value
    np.testing.assert_array_equal(dparams2[table], dparams[table])
    np.testing.assert_array_equal(dx2_BTD, dx_BTD)
    # and the value is the assistant tokens' mean cross-entropy, computed from the logits
    logits_BTV = (x_BTD @ params[table].T)[..., : cfg.model.vocab_size]
    nats_BT = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits_BTV)), np.asarray(tokens_BT1)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(value, nats_BT[~masked_BT].mean(), rtol=1e-6)


def test_packed_conversations_score_as_each_alone(chats):
    """Each conversation's masked nats inside a packed window equal its nats in a window of its own:
    document masking and positions restarting at each conversation (fp32; 2e-5 as test_documents.py)."""
    cfg = tiny_config(*QWEN3, *SFT)
    graphdef, params = _perturbed(cfg)
    logp = jax.jit(lambda p, t: jax.nn.log_softmax(nnx.merge(graphdef, p)(t)[..., : cfg.model.vocab_size], axis=-1))

    def forward(tokens_BT):
        return logp(params, tokens_BT)
    convs = chats[0]
    window, weights = convs.windows(128)[0]
    assert len(convs.windows(128).groups[0]) >= 2  # several conversations packed
    logp_TV = np.asarray(forward(window[None, :-1]))[0]
    at = 0
    for i in convs.windows(128).groups[0]:
        ids, mask = convs.conversation(i)
        alone = np.zeros(128, np.int32)
        alone[:len(ids) - 1] = ids[:-1]
        logp_alone = np.asarray(forward(alone[None]))[0]
        w = mask[1:].astype(bool)
        packed = logp_TV[at + np.arange(len(ids) - 1), ids[1:]][w]
        np.testing.assert_allclose(packed, logp_alone[np.arange(len(ids) - 1), ids[1:]][w], rtol=0, atol=2e-5)
        np.testing.assert_array_equal(weights[at:at + len(ids) - 1], mask[1:])
        at += len(ids)


def _steps(cfg, devices, batches, val: bool = True) -> tuple[list[float], float | None]:
    """(the loss of each train step on `batches` from fresh init, the val loss of the first batch after
    them, or None without `val`)."""
    mesh = make_mesh(validate(cfg, len(devices)), devices)
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state, step = init_state(cfg, setup), make_train_step(cfg, mesh, setup)
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        if val:
            val = float(make_eval_step(cfg, mesh, setup)(state.params, batches[0])["loss"])
    return losses, val or None


@pytest.fixture(scope="module")
def references(chats):
    batches = _batches(chats)
    """One device, the reference forms (model.ops=reference, jaxgpt/model/ops.py): the layouts run the tuned ones."""
    return {kind: _steps(tiny_config(*keys, *SFT, "model.moe_dispatch=dropless", "model.ops=reference"),
                         jax.devices()[:1], batches)
            for kind, keys in (("dense", QWEN3), ("moe", QWEN3_MOE))}


@pytest.mark.parametrize("kind, layout, overrides", [
    ("dense", "dp=2,fsdp=2,tp=2", ()),
    ("dense", "pp=2,dp=4", ("train.grad_accum=2",)),  # the masked loss over micro-batches and stages
    ("moe", "cp=2,ep=4", ()),  # each window split over cp, experts over ep
])
def test_every_layout_family_masks_as_one_device(chats, references, kind, layout, overrides):
    keys, pipelined = (QWEN3 if kind == "dense" else QWEN3_MOE), layout.startswith("pp")
    losses, val = _steps(tiny_config(*keys, *SFT, "model.moe_dispatch=dropless", *overrides, mesh=layout),
                         jax.devices(), _batches(chats), val=pipelined)  # the eval step's own path: pp's
    want_losses, want_val = references[kind]
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=LOSS_ATOL)
    if pipelined:
        np.testing.assert_allclose(val, want_val, rtol=0, atol=LOSS_ATOL)
    assert abs(want_val - want_losses[0]) > 100 * LOSS_ATOL  # batch 0 after the updates: the gradients moved it


def test_fine_tune_then_chat_then_export(qwen, tmp_path, capsys, monkeypatch):
    """A Qwen3-shaped model with its own tokenizer: data.chat -> train -> sample --chat (one turn and a
    conversation on stdin) -> export, whose AutoTokenizer renders our chat ids."""
    from transformers import AutoTokenizer

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in bundled_conversations(60, seed=5)))
    run = tmp_path / "run"
    cfg = tiny_config(*QWEN3, *SFT, f"data.chat={chats}", f"data.tokenizer={qwen}", "data.chat_val_fraction=0.2",
                      "train.steps=3", "train.eval_every=3", "train.batch_size=4")
    train(cfg, run, jax.devices()[:1])
    evals = [r for r in read_metrics(run) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 3] and evals[1]["val_loss"] < evals[0]["val_loss"]
    out = capsys.readouterr().out
    assert "chat data" in out and "60 conversations (48 train, 12 val)" in out

    args = [str(run), "--chat", "--temperature", "0", "--max-new-tokens", "6"]
    assert sample.main([*args, "--prompt", "What is 2 + 3?"]) == 0
    reply = capsys.readouterr().out
    assert reply.endswith("\n") and "<|im_end|>" not in reply and "<|im_start|>" not in reply
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nWhat is 2 + 3?\n\n"))
    assert sample.main([*args, "--system", "Be brief."]) == 0
    assert capsys.readouterr().out.count("\n") >= 2  # two replies, each on its own line
    assert sample.main([str(run), "--chat", "--num-samples", "2", "--prompt", "x"]) == 2
    assert "--chat answers one reply at a time" in capsys.readouterr().err

    assert export(run, tmp_path / "hf") == 3
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    template = ChatTemplate(tokenizer.load(str(qwen)))
    messages = bundled_conversations(1, seed=9)[0]["messages"]
    ids, _ = template.encode(template.check(messages))
    assert auto.apply_chat_template(messages, tokenize=True, return_dict=True,
                                    enable_thinking=False)["input_ids"] == ids[1:].tolist()
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["model_type"], hf_cfg["eos_token_id"], hf_cfg["bos_token_id"]) == ("qwen3", 386, None)


def test_the_bundled_sft_config_reads_its_chat_set():
    """configs/sft-tiny.yaml is valid, and its generated set (data.chat=bundled) fits its windows whole."""
    from jaxgpt.chat.bundled import bundled_chats

    cfg = load_config("sft-tiny")
    validate(cfg, 1)
    assert input_files(cfg.data.chat) == [bundled_chats()]
    lines = bundled_chats().read_text().splitlines()
    template = ChatTemplate(tokenizer.load(cfg.data.tokenizer))
    assert len(lines) == 4000 and template.origin == "the built-in ChatML one"
    longest = max(len(template.encode(template.check(json.loads(line)["messages"]))[0]) for line in lines[:300])
    assert 100 < longest <= cfg.model.seq_len + 1  # none truncated


def test_a_streamed_reply_is_its_text_up_to_the_end_of_turn(capsys):
    gpt2 = tokenizer.load("gpt2")
    ids = gpt2.encode("Héllo! How can I help you today?<|im_end|>\n<|im_start|>user")
    assert sample._stream(gpt2, iter(ids), "<|im_end|>") == "Héllo! How can I help you today?"
    assert capsys.readouterr().out == "Héllo! How can I help you today?"
    assert sample._stream(gpt2, iter(ids[:3])) == gpt2.decode(ids[:3]) == capsys.readouterr().out
