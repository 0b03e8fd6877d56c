"""`python -m jaxgpt.sample RUN_DIR [--prompt TEXT | --prompt-file F] [--chat [--system TEXT]] [options]`: text from a checkpoint.

Generation uses a KV cache: one jitted prefill runs the prompt through the model and fills every
layer's keys and values; then a jitted decode step feeds one token per sample, attends to the
cache, and writes its own key/value at the next slot. Each new token costs one position's work
instead of re-running the whole sequence (tests check both give the same tokens). Text longer
than the model's context is generated as nanoGPT does, by cropping: when the cache is full, the
newest half of the context is prefilled again (from position 0) and decoding goes on from there.

Sampling: logits / temperature, then top-k (keep the k most likely), then top-p (keep the smallest
set whose probability reaches p), then a categorical draw from the seed. temperature=0 is greedy.

With one sample the text is streamed as it is generated; with several, each is printed when done.
Text is the run's tokenizer's (RUN_DIR/tokenizer, else GPT-2's: jaxgpt/tokenizer.py).

`--chat` talks to a fine-tuned model in its chat template (the run's data.chat_template, else its
tokenizer's own, else the built-in one it was trained with: jaxgpt/chat/template.py): `--prompt` is
one user message, answered once; without it, each line on stdin is one (an empty line or Ctrl-D
ends the conversation). Every turn renders the whole conversation again, dropping its oldest
turns (a system message stays) so that it and the reply fit the context, and the reply stops at
the template's end-of-turn marker (`<|im_end|>`, Llama 3's `<|eot_id|>`) or after --max-new-tokens.
`--mesh` shards the parameters by the same table as training, so a model too big for one device
samples across several; the samples themselves are small and left replicated. An MoE model samples
with no expert capacity limit (jaxgpt/model/moe.py: `drop=False`), so no token is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Iterator, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgpt import files, tokenizer
from jaxgpt.chat.template import BadConversation, ChatTemplate
from jaxgpt.cli import ArgumentParser, path_arg, run_main
from jaxgpt.config import NONNEGATIVE, POSITIVE, SEED, Config, Range, mesh_shape, parse_mesh
from jaxgpt.errors import UserError
from jaxgpt.lowering import compute_dtype
from jaxgpt.model import KVCache
from jaxgpt.parallel.mesh import make_mesh
from jaxgpt.step import abstract_model, make_setup


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


@functools.lru_cache(maxsize=8)
def _steps(graphdef, cfg: Config, B: int, temperature: float, top_k: int, top_p: float):
    """(prefill, decode), jitted once per model and sampling options: a chat's every turn reuses
    them (prefill compiles once per prompt length, decode once)."""
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

    return prefill, decode


def _generate(graphdef, params, cfg, prompt_BT, max_new_tokens, temperature, top_k, top_p, seed):
    prefill, decode = _steps(graphdef, cfg, prompt_BT.shape[0], temperature, top_k, top_p)

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

    parser = ArgumentParser(prog="python -m jaxgpt.sample", description="Generate text from a jaxgpt checkpoint, or "
                                                                        "chat with a fine-tuned one (--chat).")
    parser.add_argument("run", type=path_arg, help="a run dir or its checkpoints dir (the newest checkpoint is used)")
    parser.add_argument("--prompt", default=None, help="text to continue (default: a newline); the tokenizer's "
                                                       "special tokens in it (GPT-2's <|endoftext|>, the document "
                                                       "separator) are read as such; with --chat: one user message, "
                                                       "answered once")
    parser.add_argument("--prompt-file", type=path_arg, help="read the prompt from this file instead")
    parser.add_argument("--chat", action="store_true", help="chat in the run's chat template (what it was fine-tuned "
                        "on): an interactive loop (one line a message; an empty line or Ctrl-D ends it), or one "
                        "turn with --prompt; each reply stops at the template's end-of-turn marker")
    parser.add_argument("--system", help="with --chat: a system message before the conversation")
    for flag, kind, default, doc in [
            ("--max-new-tokens", int, 200, "tokens to generate after the prompt (with --chat: per reply, at most"
                                           " half the context)"),
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
        if args.prompt is not None:
            raise UserError("give --prompt or --prompt-file, not both")
        args.prompt = files.read_text(args.prompt_file, "--prompt-file")
    if args.chat and args.num_samples != 1:
        raise UserError("--chat answers one reply at a time: leave --num-samples at 1")
    if args.system is not None and not args.chat:
        raise UserError("--system is a chat's system message: add --chat")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system)):
        if text is not None and not files.is_unicode(text):  # bytes that are not UTF-8 reach argv as lone surrogates
            raise UserError(f"{flag} is not UTF-8 text")
    session: dict = {}

    def check(cfg: Config) -> None:  # before any parameter is read
        tok = session["tok"] = tokenizer.of_run(args.run, cfg.data.tokenizer)
        tokenizer.check_fits_model(tok, cfg.model.vocab_size)
        if args.chat:
            session["template"] = ChatTemplate(tok, cfg.data.chat_template)
        else:
            prompt = "\n" if args.prompt is None else args.prompt
            session["prompt"] = tok.encode_special(prompt) or [tok.separator_id]
            check_fits(len(session["prompt"]), cfg)
        check_host_memory(cfg, args.num_samples)

    params, cfg, step = restore_params(args.run, check=check)
    if args.mesh:
        params, _ = shard_params(params, cfg, args.mesh)
    graphdef, _ = abstract_model(cfg)
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.chat:
        _chat(graphdef, params, cfg, session["template"], args, options)
        return
    tok, prompt = session["tok"], session["prompt"]
    prompt_BT = np.tile(np.asarray(prompt, np.int32), (args.num_samples, 1))
    tokens = generate(graphdef, params, cfg, prompt_BT, args.max_new_tokens, **options)
    print(f"# {args.run} (step {step}), {args.num_samples} sample(s) of {args.max_new_tokens} tokens", file=sys.stderr)
    text = "\n" if args.prompt is None else args.prompt
    if args.num_samples == 1:
        sys.stdout.write(text)
        _stream(tok, (int(t[0]) for t in tokens))
        sys.stdout.write("\n")
        return
    columns = np.stack(list(tokens), axis=1)
    for i, row in enumerate(columns):
        print(f"--- sample {i + 1}\n{text}{tok.decode(row.tolist())}")


def _stream(tok: tokenizer.Tokenizer, ids, stop: str | None = None, stop_ids: frozenset[int] = frozenset()) -> str:
    """Writes the text of `ids` to stdout as it comes (a character split over tokens once whole); with
    `stop`, up to where that text first appears, or up to a token in `stop_ids`. Returns the text written."""
    out, shown, hold = [], "", len(stop) - 1 if stop else 0
    for token in ids:
        if token in stop_ids:
            break
        out.append(token)
        text = tok.decode(out)
        if text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            continue
        if stop and (end := text.find(stop)) >= 0:
            sys.stdout.write(text[len(shown):end])
            return text[:end]
        safe = text[:max(0, len(text) - hold)]  # a stop marker's start is kept back until it cannot be one
        if len(safe) > len(shown):
            sys.stdout.write(safe[len(shown):])
            sys.stdout.flush()
            shown = safe
    text = tok.decode(out)
    sys.stdout.write(text[len(shown):])
    return text


def _chat(graphdef, params, cfg: Config, template: ChatTemplate, args, options: dict) -> None:
    """--chat: one reply to --prompt, or a conversation read line by line from stdin. Each turn the
    whole conversation is rendered again by the template (the oldest turns dropped to fit the
    context: ChatTemplate.prompt) and the reply is generated up to the end-of-turn marker."""
    tok, seq = template.tok, cfg.model.seq_len
    budget = min(args.max_new_tokens, max(1, seq // 2))
    stop_ids = frozenset({tok.separator_id} | ({tok.specials[tok.eos]} if tok.eos in tok.specials and
                                                 tok.eos != template.end_of_turn else set()))
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    interactive = args.prompt is None
    if interactive and sys.stdin.isatty():
        print(f"# chatting with {args.run} ({template.origin} template); an empty line or Ctrl-D ends it", file=sys.stderr)
    for turn in range(10**9):
        if not interactive:
            if turn:
                return
            user = args.prompt
        else:
            try:
                user = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                return
            if not user.strip():
                return
        messages.append({"role": "user", "content": user})
        try:
            template.check(messages, need_assistant=False)
        except BadConversation as e:
            raise UserError(f"--chat: {e}") from None
        ids = template.prompt(messages, seq - budget)
        tokens = generate(graphdef, params, cfg, np.asarray([ids], np.int32), budget, **{**options, "seed":
                                                                                          options["seed"] + turn})
        reply = _stream(tok, (int(t[0]) for t in tokens), template.end_of_turn, stop_ids)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply.strip()})


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
