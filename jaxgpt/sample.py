"""`python -m jaxgpt.sample RUN_DIR [--prompt TEXT | --prompt-file F] [options]`: text from a checkpoint.

Generation uses a KV cache: one jitted prefill runs the prompt through the model and fills every
layer's keys and values; then a jitted decode step feeds one token per sample, attends to the
cache, and writes its own key/value at the next slot. Each new token costs one position's work
instead of re-running the whole sequence (tests check both give the same tokens). Text longer
than the model's context is generated as nanoGPT does, by cropping: when the cache is full, the
newest half of the context is prefilled again (from position 0) and decoding goes on from there.

Sampling: logits / temperature, then top-k (keep the k most likely), then top-p (keep the smallest
set whose probability reaches p), then a categorical draw from the seed. temperature=0 is greedy.

With one sample the text is streamed as it is generated; with several, each is printed when done.
`--mesh` shards the parameters by the same table as training, so a model too big for one device
samples across several; the samples themselves are small and left replicated. An MoE model samples
with no expert capacity limit (jaxgpt/model/moe.py: `drop=False`), so no token is dropped.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterator, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgpt import files
from jaxgpt.cli import ArgumentParser, path_arg, run_main
from jaxgpt.config import NONNEGATIVE, POSITIVE, SEED, Config, Range, mesh_shape, parse_mesh
from jaxgpt.errors import UserError
from jaxgpt.lowering import compute_dtype
from jaxgpt.model import KVCache
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import abstract_model, make_setup
from jaxgpt.tokenizer import EOT_TEXT, check_ids_fit, gpt2_encoding


MAX_TEMPERATURE = 1e30


def filter_logits(logits_BV: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Temperature, top-k and top-p applied to fp32 logits; removed entries become -inf."""
    # Past MAX_TEMPERATURE every temperature samples uniformly; capped because XLA divides by
    # multiplying with 1 / temperature, which underflows to 0 past fp32's range (1e38), and the
    # padding's -inf times 0 is NaN (a padding id then came out of the draw).
    logits_BV = logits_BV / min(temperature, MAX_TEMPERATURE)
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        cum_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
        # the smallest logit still inside the nucleus (the first one always is)
        cutoff_B1 = jnp.take_along_axis(sorted_BV, jnp.sum(cum_BV < top_p, axis=-1, keepdims=True), axis=-1)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return logits_BV


def _pick(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits_BV, temperature, top_k, top_p)).astype(jnp.int32)


def generate(graphdef: nnx.GraphDef, params: dict, cfg: Config, prompt_BT: np.ndarray, max_new_tokens: int, *,
             temperature: float = 0.8, top_k: int = 200, top_p: float = 1.0, seed: int = 0) -> Iterator[np.ndarray]:
    """An iterator over the next token of every sample, [B], max_new_tokens times (KV-cached)."""
    check_fits(prompt_BT.shape[1], cfg)  # here, not in the generator below, so it fails at the call
    return _generate(graphdef, params, cfg, prompt_BT, max_new_tokens, temperature, top_k, top_p, seed)


def check_fits(prompt_tokens: int, cfg: Config) -> None:
    """The prompt must fit the context; the generated text may run past it (`_generate`)."""
    if prompt_tokens > cfg.model.seq_len:
        raise UserError(f"the prompt ({prompt_tokens} tokens) is longer than the model's context of "
                        f"{cfg.model.seq_len} tokens; shorten it")


def check_host_memory(cfg: Config, num_samples: int) -> None:
    """On a CPU, one line before anything is read instead of the kernel's OOM killer part-way. An
    estimate, not a bound: the parameters (fp32, as restored), the KV cache ([L, B, seq_len, G, K]
    keys and values) and the next token's fp32 logits ([B, V]; a prefill computes only the last
    position's) are held at once, and XLA's temporaries around the cache and the logits (the
    prefill's empty cache, the sampling filters' copies of [B, V]) measured 1.5 times as much again
    on CPU for the default model (docs/benchmarks.md): so 2.5 x (cache + logits). The prompt's
    activations are not counted (at most seq_len positions). A GPU's out-of-memory is XLA's
    RESOURCE_EXHAUSTED, one line from run_main."""
    from jaxgpt.model import param_count
    from jaxgpt.plan import GIB, host_memory_available

    if jax.devices()[0].platform != "cpu" or (available := host_memory_available()) is None:
        return
    m = cfg.model
    params = 4 * param_count(m)
    cache = 2 * m.n_layer * num_samples * m.seq_len * m.kv_heads * m.head_dim * np.dtype(
        compute_dtype(m.dtype, "cpu")).itemsize
    logits = 4 * num_samples * m.padded_vocab
    need = params + SAMPLING_TEMPORARIES * (cache + logits)
    if need > available:
        raise UserError(f"sampling needs about {need / GIB:.1f} GiB of host memory (parameters {params / GIB:.1f} GiB, "
                        f"KV cache {cache / GIB:.1f} GiB and the next token's logits {logits / GIB:.1f} GiB, "
                        f"{SAMPLING_TEMPORARIES} times with XLA's temporaries), but {available / GIB:.1f} GiB is "
                        f"available; use fewer --num-samples or a machine with more memory")


SAMPLING_TEMPORARIES = 2.5  # peak host memory / (KV cache + logits), measured for 500-4,000 samples


def _generate(graphdef, params, cfg, prompt_BT, max_new_tokens, temperature, top_k, top_p, seed):
    B, _ = prompt_BT.shape
    dtype = compute_dtype(cfg.model.dtype, jax.devices()[0].platform)
    pick = partial(_pick, temperature=temperature, top_k=top_k, top_p=top_p)

    @jax.jit
    def prefill(params, tokens_BT, key):
        logits_BTV, cache = nnx.merge(graphdef, params)(tokens_BT, dtype, KVCache.empty(cfg.model, B, dtype))
        return pick(logits_BTV[:, -1], key), cache

    @partial(jax.jit, donate_argnums=2)
    def decode(params, token_B, cache, key):
        logits_BTV, cache = nnx.merge(graphdef, params)(token_B[:, None], dtype, cache)
        return pick(logits_BTV[:, -1], key), cache

    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    token_B, cache = prefill(params, jnp.asarray(prompt_BT, jnp.int32), keys[0])
    out = [np.asarray(token_B)]
    yield out[-1]
    pos, seq, keep = prompt_BT.shape[1], cfg.model.seq_len, max(1, cfg.model.seq_len // 2)
    for i in range(1, max_new_tokens):
        if pos < seq:  # room in the cache for the newest token
            token_B, cache = decode(params, token_B, cache, keys[i])
            pos += 1
        else:  # the context is full: start again from its newest half (positions from 0, as nanoGPT crops)
            window_BT = np.concatenate([prompt_BT, np.stack(out, axis=1)], axis=1)[:, -keep:]
            token_B, cache = prefill(params, jnp.asarray(window_BT, jnp.int32), keys[i])
            pos = keep
        out.append(np.asarray(token_B))
        yield out[-1]


# Each numeric flag's allowed values, checked (with its own message) before anything is loaded.
FLAG_RANGES = {"--max-new-tokens": POSITIVE, "--num-samples": POSITIVE, "--temperature": NONNEGATIVE,
               "--top-k": NONNEGATIVE, "--top-p": Range(0, 1, lo_open=True), "--seed": SEED}


def _sample(argv: Sequence[str] | None) -> None:
    from jaxgpt.hf import restore_params  # restores the newest readable checkpoint on one device

    parser = ArgumentParser(prog="python -m jaxgpt.sample", description="Generate text from a jaxgpt checkpoint.")
    parser.add_argument("run", type=path_arg, help="a run dir or its checkpoints dir (the newest checkpoint is used)")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline); <|endoftext|> in it "
                                                       "is the document separator")
    parser.add_argument("--prompt-file", type=path_arg, help="read the prompt from this file instead")
    for flag, kind, default, doc in [
            ("--max-new-tokens", int, 200, "tokens to generate after the prompt"),
            ("--temperature", float, 0.8, "0 = greedy"),
            ("--top-k", int, 200, "0 = no top-k filter"),
            ("--top-p", float, 1.0, "nucleus sampling threshold; 1 = off"),
            ("--seed", int, 0, "seed of the draws"),
            ("--num-samples", int, 1, "samples, generated as one batch")]:
        parser.add_argument(flag, type=kind, default=default, help=f"{doc} ({FLAG_RANGES[flag]}; default {default})")
    parser.add_argument("--mesh", help="shard the parameters over this mesh, e.g. tp=2 or fsdp=8")
    args = parser.parse_args(argv)
    for flag, allowed in FLAG_RANGES.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value not in allowed:
            finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
            raise UserError(f"{flag} must be {finite}{allowed}, got {value}")
    if args.prompt_file is not None:
        if any(a == "--prompt" or a.startswith("--prompt=") for a in (sys.argv[1:] if argv is None else argv)):
            raise UserError("give --prompt or --prompt-file, not both")
        args.prompt = files.read_text(args.prompt_file, "--prompt-file")
    enc = gpt2_encoding()
    # "<|endoftext|>" in a prompt is the document separator, as Hugging Face's GPT-2 tokenizer reads it
    if not files.is_unicode(args.prompt):  # bytes that are not UTF-8 reach argv as lone surrogates
        raise UserError("--prompt is not UTF-8 text")
    prompt = enc.encode(args.prompt, allowed_special={EOT_TEXT}) or [enc.eot_token]
    def check(cfg: Config) -> None:  # before any parameter is read
        check_fits(len(prompt), cfg)
        check_ids_fit(max(prompt), cfg.model.vocab_size, "the prompt")
        check_host_memory(cfg, args.num_samples)

    params, cfg, step = restore_params(args.run, check=check)
    if args.mesh:
        params, _ = shard_params(params, cfg, args.mesh)
    prompt_BT = np.tile(np.asarray(prompt, np.int32), (args.num_samples, 1))
    graphdef, _ = abstract_model(cfg)
    tokens = generate(graphdef, params, cfg, prompt_BT, args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(f"# {args.run} (step {step}), {args.num_samples} sample(s) of {args.max_new_tokens} tokens", file=sys.stderr)
    if args.num_samples == 1:
        out, shown = [], ""
        sys.stdout.write(args.prompt)
        for token_B in tokens:
            out.append(int(token_B[0]))
            text = enc.decode(out)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
        sys.stdout.write("\n")
        return
    columns = np.stack(list(tokens), axis=1)
    for i, row in enumerate(columns):
        print(f"--- sample {i + 1}\n{args.prompt}{enc.decode(row.tolist())}")


def shard_params(params: dict, cfg: Config, spec: str, command: str = "sampling") -> tuple[dict, Mesh]:
    """(the parameters placed on a mesh of all devices, sharded as in training; that mesh)."""
    try:
        sizes = {key.split(".")[1]: int(size) for key, size in parse_mesh(spec).items()}
    except ValueError:
        raise UserError(f"--mesh {spec}: axis sizes must be integers") from None
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **sizes))
    shape = mesh_shape(cfg.mesh, jax.device_count())
    if shape["pp"] > 1:
        raise UserError(f"--mesh {spec}: {command} does not pipeline (pp={shape['pp']}); split a model too big for "
                        f"one device with tp or fsdp instead")
    checks = [("tp", cfg.model.n_head, "model.n_head"), ("tp", cfg.model.kv_heads, "model.n_kv_head"),
              ("fsdp", cfg.model.n_embd, "model.n_embd")]
    if cfg.model.moe_experts:  # a dense model is replicated over ep
        checks.append(("ep", cfg.model.moe_experts, "model.moe_experts"))
    for axis, dim, name in checks:
        if dim % shape[axis]:
            raise UserError(f"--mesh {spec}: {axis}={shape[axis]} does not divide {name}={dim}")
    mesh = make_mesh(shape)
    return jax.device_put(params, make_setup(cfg, mesh).shardings.params), mesh


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_sample, argv)


if __name__ == "__main__":
    sys.exit(main())
