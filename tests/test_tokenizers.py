"""Issue 61 item 1: a model's own tokenizer (data.tokenizer). Tokenizers built here with tokenizers' BPE
trainer on the bundled text (no download): a Qwen-shaped tokenizer.json and a Llama-3-shaped tiktoken
file. Their ids are AutoTokenizer's on unicode text; a tiktoken file exports as a tokenizer.json that
AutoTokenizer reads to the same ids and jaxgpt to the same identity; GPT-2's export is GPT-2 again;
prepare -> train -> sample -> export -> import keeps the tokenizer; the wrong one, or a file that is
none, is one line."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import REPO, UNICODE, llama3_tokenizer, qwen_tokenizer, tiny_config

from jaxgpt import data, prepare, sample, tokenizer
from jaxgpt.cli import EXIT_USER_ERROR
from jaxgpt.errors import UserError
from jaxgpt.hf import export, import_dir
from jaxgpt.hf.tokenizer import write
from jaxgpt.train import train

PIECES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "Zz", "7", "42", "1234", "'s", "'LL", "é", "ß", "日本", "🤖",
          "e\u0301", "\u00a0", "\u3000", ".", "--", "<|im_end|>", "<|begin_of_text|>", "<|endoftext|"]


def _texts() -> list[str]:
    rng = np.random.default_rng(0)
    shakespeare = (REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt").read_text()
    return [*UNICODE, "", "   ", "I'll DON'T they're 3.14159", shakespeare[:5000], shakespeare[-3000:],
            *("".join(rng.choice(PIECES, 25)) for _ in range(40))]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    return qwen_tokenizer(d / "qwen"), llama3_tokenizer(d / "llama" / "tokenizer.model")


def _same_ids(ours: tokenizer.Tokenizer, auto) -> None:
    for text in _texts():
        ids = ours.encode_special(text)
        assert auto(text, add_special_tokens=False).input_ids == ids, repr(text)
        assert auto.decode(ids) == ours.decode(ids) == text, repr(text)
        # text as text: special tokens' spellings are characters (what prepare encodes documents with)
        assert auto(text, add_special_tokens=False, split_special_tokens=True).input_ids == ours.encode(text), repr(text)


def test_ids_equal_autotokenizers_and_an_export_keeps_its_identity(toks, tmp_path):
    from transformers import AutoTokenizer

    qwen_dir, llama_file = toks
    qwen = tokenizer.load(str(qwen_dir))
    assert (qwen.n_vocab, qwen.separator, qwen.separator_id, qwen.eos) == (387, "<|endoftext|>", 384, "<|im_end|>")
    _same_ids(qwen, AutoTokenizer.from_pretrained(qwen_dir))

    llama = tokenizer.load(str(llama_file))  # Llama 3's pattern and its 256 special tokens after the ranks
    assert (llama.n_vocab, llama.separator_id, llama.specials["<|eot_id|>"]) == (640, 384, 393)
    (tmp_path / "llama").mkdir()
    (tmp_path / "gpt2").mkdir()
    assert write(tmp_path / "llama", 64, llama) == ["tokenizer.json", "tokenizer_config.json"]
    _same_ids(llama, AutoTokenizer.from_pretrained(tmp_path / "llama"))  # converted as transformers converts it
    assert tokenizer.load(str(tmp_path / "llama")).sha256 == llama.sha256  # read back: the same tokenizer
    config = json.loads((tmp_path / "llama" / "tokenizer_config.json").read_text())
    (tmp_path / "llama" / "tokenizer.json").write_text((tmp_path / "llama" / "tokenizer.json").read_text() + " ")
    assert tokenizer.load(str(tmp_path / "llama")).sha256 != llama.sha256  # an edited file is another one
    assert config["bos_token"] == "<|begin_of_text|>" and config["eos_token"] == "<|end_of_text|>"

    write(tmp_path / "gpt2", 64)  # GPT-2's export is GPT-2's tokenizer again
    assert tokenizer.load(str(tmp_path / "gpt2")) is tokenizer.load("gpt2")


@pytest.mark.parametrize("content, message", [
    (b"ROMEO: not a tokenizer\n", "is not a tokenizer: neither a Hugging Face tokenizer.json (JSON) nor a tiktoken BPE "
                                  "file (lines of 'base64-token rank'); line 1 is not"),
    (b'{"model": 3}', "is not a Hugging Face tokenizer.json"),
    (b"IQ== 0\nIg== 2\n", "its ranks are not 0..1, each once"),
    (b"IQ== 0\n", "a byte-level BPE needs all 256 single bytes, but byte 0 has no token"),
])
def test_a_file_that_is_not_a_tokenizer_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "tokenizer.bin"
    path.write_bytes(content)
    with pytest.raises(UserError) as e:
        tokenizer.load(str(path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    (tmp_path / "doc.txt").write_text("To be, or not to be.\n" * 50)
    assert prepare.main([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"), "--tokenizer", str(path)]) \
        == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "out").exists()


def test_prepare_train_sample_export_import_keep_the_tokenizer(toks, tmp_path, capsys):
    """A Llama-3-shaped model with its own tiktoken tokenizer: prepare with it, train on it (GPT-2's
    data refused, and its data refused to a GPT-2 run), sample, export (AutoTokenizer reads the
    export's ids), import the export (the same tokenizer to jaxgpt: the data still fits)."""
    from transformers import AutoTokenizer

    _, llama_file = toks
    llama = tokenizer.load(str(llama_file))
    text = (REPO / "jaxgpt" / "assets" / "tinyshakespeare.txt").read_text()[:60_000]
    (tmp_path / "plays.txt").write_text(text)
    out = tmp_path / "prepared"
    assert prepare.main([str(tmp_path / "plays.txt"), "--out", str(out), "--tokenizer", str(llama_file),
                         "--workers", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["tokenizer_sha256"], meta["vocab_size"]) == (llama.sha256, 640)
    tokens = np.concatenate([np.asarray(data.load_split(out, s)) for s in ("train", "val")])
    assert llama.decode(tokens.tolist()).replace("<|begin_of_text|>", "") == text  # val is the text's tail
    with pytest.raises(UserError, match=r"was tokenized with another tokenizer .* than this run's data.tokenizer=gpt2"):
        data.open_splits(str(out))

    keys = ["model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false", "model.vocab_size=640",
            "model.tie_embeddings=false", "model.n_kv_head=2", "train.steps=2", f"data.tokenizer={llama_file}"]
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"prepared was tokenized with another tokenizer"):
        train(tiny_config(*keys[:-1], "data.tokenizer=gpt2", f"data.path={out}"), run, jax.devices()[:1])
    with pytest.raises(UserError, match="model.document_token=385 is not the document separator of data.tokenizer"):
        train(tiny_config(*keys, f"data.path={out}", "model.document_mask=true", "model.document_token=385"), run,
              jax.devices()[:1])
    train(tiny_config(*keys, f"data.path={out}"), run, jax.devices()[:1])
    assert tokenizer.of_run(run).sha256 == llama.sha256  # kept in the run dir
    with pytest.raises(UserError, match=r"was trained with another tokenizer .* set data.tokenizer="):
        train(tiny_config(*keys[:-1], "train.steps=3"), run, jax.devices()[:1])  # resumed with GPT-2's

    capsys.readouterr()
    assert sample.main([str(run), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert export(run, tmp_path / "hf") == 2
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto("ROMEO: héllo", add_special_tokens=False).input_ids == llama.encode("ROMEO: héllo")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (
        "llama", 640, 384, 385)
    cfg, implied = import_dir(tmp_path / "hf", tmp_path / "imported", None, ["model.loss_chunk=8"])
    assert cfg.data.tokenizer == str(tmp_path / "imported" / "tokenizer") and "data.tokenizer" in implied
    assert cfg.model.document_token == 384
    assert data.open_splits(str(out), tok=tokenizer.load(cfg.data.tokenizer))[2] == 640  # the data still fits


def test_transformers_llama3_with_its_own_tokenizer_gives_our_logits_and_greedy_text(toks, tmp_path, capsys):
    """By hand (torch): a Llama-3-shaped model with its tiktoken tokenizer, written as an HF directory
    (the tokenizer converted), `hf import`ed and exported back: LlamaForCausalLM + AutoTokenizer give our
    logits to 1e-5 and greedy `generate` the text of `jaxgpt.sample --temperature 0`."""
    pytest.importorskip("torch")
    from safetensors.numpy import save_file
    from test_hf import LLAMA_3, _perturbed, _transformers_matches

    from jaxgpt import hf
    from jaxgpt.hf import llama as hf_llama

    llama = tokenizer.load(str(toks[1]))
    cfg = tiny_config(*LLAMA_3, "model.vocab_size=640")
    graphdef, params = _perturbed(cfg)
    (tmp_path / "source").mkdir()
    write(tmp_path / "source", 32, llama)
    save_file(hf_llama.to_hf(params, cfg.model), tmp_path / "source" / "model.safetensors")
    (tmp_path / "source" / "config.json").write_text(json.dumps(hf_llama.hf_config(cfg.model)))
    assert hf.main(["import", str(tmp_path / "source"), str(tmp_path / "run"), "model.loss_chunk=8"]) == 0
    assert tokenizer.of_run(tmp_path / "run").sha256 == llama.sha256
    assert export(tmp_path / "run", tmp_path / "out") == 0
    _transformers_matches((cfg, graphdef, params, tmp_path), "LlamaForCausalLM", capsys)
