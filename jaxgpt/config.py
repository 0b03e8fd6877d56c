"""Typed configuration: defaults in dataclasses, differences in YAML, last words on the command line.

A run's config is built in three layers, each checked against the dataclasses below:

    defaults (this file)  <-  configs/NAME.yaml (only what differs)  <-  section.key=value overrides

Every field carries a one-line `doc` and, if numeric, the `Range` of values that make sense;
`--help` prints both. An unknown key, a value of the wrong type, or a number outside its range
(a NaN or an infinity is outside every range) raises `UserError` naming the key, the value and the
nearest valid spelling, when the config is built, before JAX compiles anything. `validate` checks
the ranges again (for configs built in code) plus what needs the device count (mesh product,
divisibility by mesh axes), also before compilation.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxgpt import files
from jaxgpt.errors import UserError
from jaxgpt.hlo import BLOCK_LINEARS

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "shakespeare"
VOCAB_MULTIPLE = 128  # the embedding/head is padded to this; the padding never gets probability


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: an interval (ends open or closed), plus listed extras."""
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    extra: tuple[int, ...] = ()  # also allowed, e.g. -1 for "the rest" on mesh axes

    def __contains__(self, value: float) -> bool:
        if value in self.extra:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if math.isinf(self.hi):
            text = f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        else:
            text = f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"
        return " or ".join([*map(str, self.extra), text])


POSITIVE, NONNEGATIVE = Range(0, lo_open=True), Range(0)
UNIT = Range(0, 1)  # [0, 1]
BETA = Range(0, 1, hi_open=True)  # [0, 1): an Adam beta of 1 never forgets, >1 diverges
MESH_AXIS = Range(1, extra=(-1,))
SEED = Range(0, 2**32 - 1)  # what Grain's shuffle accepts


def _f(default: Any, doc: str, choices: tuple[str, ...] | None = None, range: Range | None = None,
       words: Any = None) -> Any:
    """words: for a key that also takes strings besides its type's values (model.fp8: true, false,
    auto or a list of layers), a function (key, the YAML or command-line value) -> the value, raising
    UserError for anything else."""
    if range is None and type(default) in (int, float):
        range = Range()  # finite, at least; test_config asks every numeric key for a real range
    return field(default=default, metadata={"doc": doc, "choices": choices, "range": range, "words": words})


def _fp8_words(key: str, raw: Any) -> bool | str:
    """model.fp8 from a YAML file or the command line: true or false, 'auto', or block linear kinds
    separated by commas (written back in BLOCK_LINEARS order, so equal lists read equal)."""
    if isinstance(raw, str):
        try:
            raw = files.load_yaml(raw) if raw.strip() else raw
        except yaml.YAMLError:
            pass  # ',' is not YAML: said below, as any other wrong value
    if isinstance(raw, bool) or raw == "auto":
        return raw
    kinds = [k.strip() for k in raw.split(",") if k.strip()] if isinstance(raw, str) else []
    wrong = next((k for k in kinds if k not in BLOCK_LINEARS), None)
    if not kinds or wrong:
        hint = _nearest(wrong, [*BLOCK_LINEARS, "auto"]) if wrong else ""
        raise UserError(f"config key '{key}' is true, false, auto or a comma-separated list of "
                        f"{', '.join(BLOCK_LINEARS)}; got {_short(raw)}{hint}")
    return ",".join(k for k in BLOCK_LINEARS if k in kinds)


# model.ops's tricks (jaxgpt/lowering/; docs/ops.md is their registry): tuned runs all of them
TRICKS = ("norm_vjp", "norm_recompute", "routed_bias", "activation_vjps", "gelu_derivative", "residual_epilogue",
          "qkv_gemms", "qkv_bias_drop", "precast", "grads_in_gemm", "tables_in_compute_dtype", "fused_loss",
          "prequantize", "fp8_pieces", "fp8_pins", "norm_amax", "activation_amax", "h_fence")
OPS_FORMS = ("auto", "reference", "tuned")


def _ops_words(key: str, raw: Any) -> str:
    """model.ops: auto, reference, tuned, or tricks separated by commas (written back in TRICKS
    order, so equal lists read equal)."""
    if not isinstance(raw, str):
        raise UserError(f"config key '{key}' is one of {', '.join(OPS_FORMS)} or a comma-separated list of "
                        f"tricks ({', '.join(TRICKS)}); got {_short(raw)}")
    if raw.strip() in OPS_FORMS:
        return raw.strip()
    names = [k.strip() for k in raw.split(",") if k.strip()]
    wrong = next((k for k in names if k not in TRICKS), None)
    if not names or wrong:
        hint = _nearest(wrong, [*OPS_FORMS, *TRICKS]) if wrong else ""
        raise UserError(f"config key '{key}' is one of {', '.join(OPS_FORMS)} or a comma-separated list of "
                        f"tricks ({', '.join(TRICKS)}); got {_short(raw)}{hint}")
    return ",".join(k for k in TRICKS if k in names)


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = _f(4, "transformer blocks", range=POSITIVE)
    n_head: int = _f(4, "attention heads per block", range=POSITIVE)
    n_embd: int = _f(128, "model width D (n_head must divide it unless head_size is set)", range=POSITIVE)
    head_size: int = _f(0, "per-head width K of q, k and v; 0 = n_embd / n_head (Qwen3-0.6B: 128 with n_embd 1024 "
                        "and 16 heads)", range=NONNEGATIVE)
    seq_len: int = _f(128, "context length T in tokens (also the number of position embeddings)", range=POSITIVE)
    vocab_size: int = _f(50257, "tokenizer vocabulary; padded to a multiple of 128 inside the model", range=POSITIVE)
    # The decoder's architecture; every default is GPT-2's, so existing configs and checkpoints keep their meaning.
    norm: str = _f("layernorm", "normalisation of the blocks and the final features: layernorm (GPT-2) or rmsnorm "
                   "(Llama)", ("layernorm", "rmsnorm"))
    norm_scale: bool = _f(True, "a learned scale in every norm; false: parameter-free norms (nanochat)")
    norm_eps: float = _f(1e-5, "epsilon added to every norm's variance (GPT-2, Llama: 1e-5; Qwen3: 1e-6)",
                         range=POSITIVE)
    position: str = _f("learned", "positions: learned embeddings wpe (GPT-2) or rotary embeddings on q and k (rope)",
                       ("learned", "rope"))
    rope_theta: float = _f(10000.0, "RoPE base: the slowest rotary frequency is 1/rope_theta (Llama 3: 500000)",
                           range=POSITIVE)
    mlp: str = _f("gelu", "MLP: gelu (GPT-2), swiglu (silu(x W_gate) * x W_in, Llama) or relu2 (relu(x W_in)^2)",
                  ("gelu", "swiglu", "relu2"))
    mlp_hidden: int = _f(0, "MLP hidden width F (also each expert's); 0 = 4 x n_embd", range=NONNEGATIVE)
    n_kv_head: int = _f(0, "key/value heads: 0 = n_head (multi-head), fewer = grouped-query attention (must "
                        "divide n_head), 1 = multi-query", range=NONNEGATIVE)
    qk_norm: bool = _f(False, "RMS-normalise each head's queries and keys before RoPE and attention")
    tie_embeddings: bool = _f(True, "the output head reuses the token embedding wte; false: a separate lm_head")
    bias: bool = _f(True, "biases in the linear layers and LayerNorms (GPT-2); false: none (Llama)")
    logit_softcap: float = _f(0.0, "cap the logits smoothly at +-c as c * tanh(logits / c) (Gemma 2); 0 = off",
                              range=NONNEGATIVE)
    dtype: str = _f("auto", "compute dtype (parameters stay fp32): auto = bfloat16 on GPU/TPU, float32 on CPU",
                    ("auto", "float32", "bfloat16"))
    attention: str = _f("auto", "attention kernel: auto = cuDNN flash attention where it can run, else xla; "
                        "mosaic = tokamax's Mosaic GPU flash attention (needs tokamax; plain causal only)",
                        ("auto", "xla", "cudnn", "mosaic"))
    document_mask: bool = _f(False, "a token attends only to earlier tokens of its own document, documents "
                             "delimited by <|endoftext|> (which begins the next one as an input); off: causal "
                             "across the whole window (jaxgpt/model/documents.py)")
    document_token: int = _f(50256, "the token id that begins a document, which model.document_mask splits windows "
                             "at: the tokenizer's document separator (GPT-2's <|endoftext|> = 50256; Llama 3's "
                             "<|begin_of_text|> = 128000; Qwen's <|endoftext|> = 151643)", range=NONNEGATIVE)
    position_reset: bool = _f(False, "with document_mask and position=rope: rotary positions restart at 0 at each "
                              "document (learned positions always index the window)")
    max_documents: int = _f(64, "cuDNN attention with document_mask: documents per window in its packed layout "
                            "(softmax statistics take this many times the memory); later ones attend as one",
                            range=Range(2))
    fp8: bool | str = _f(False, "fp8 matmuls (e4m3 forward, e5m2 gradients) for the blocks' linear layers: true "
                         "(all), false (none), auto (those the step-time model predicts faster on the target "
                         "H100/H200, jaxgpt/gpu/fp8_choice.py; none on CPU) or a list such as qkv,mlp_in,mlp_out "
                         "(of qkv, attn_out, mlp_in, mlp_gate, mlp_out, expert_in, expert_gate, expert_out)",
                         words=_fp8_words)
    ops: str = _f("auto", "how the ops compute: reference (the model's plain maths, jaxgpt/model/ops.py), tuned "
                  "(jaxgpt/lowering/'s fused and hand-written forms; docs/ops.md) or auto (tuned on a GPU, and on a "
                  "CPU the form measured faster there); a list of tricks runs those alone", words=_ops_words)
    fp8_head: bool = _f(False, "also run the tied output head's matmul and its two gradients in fp8 inside the "
                        "fused loss (logits from e4m3 x e4m3; costs some loss, see docs/gpus.md)")
    remat: str = _f("none", "recompute activations in the backward pass: none, full, save only matmul "
                    "outputs (dots, dots_no_batch), or only the fused attention kernel's (attention: recompute "
                    "the block but never its cuDNN/tokamax attention forward); auto = the least recompute whose "
                    "compiled step fits the device (on a CPU: the host memory available, shared by the local "
                    "devices)", ("none", "full", "dots", "dots_no_batch", "attention", "auto"))
    scan_layers: bool = _f(True, "run the blocks as one scanned loop (compile time independent of depth); false "
                           "unrolls it: longer compiles, but the backward pass reads each block's saved "
                           "activations in place instead of through per-layer stacked copies (faster on GPU, "
                           "above all with remat=none)")
    loss_chunk: int = _f(0, "positions per chunk of the fused head + cross-entropy: only [batch, chunk, vocab] "
                         "logits exist at a time; must divide seq_len; 0 = auto (at most max(256, n_embd) rows "
                         "per device on CPU, 8192 on GPU)", range=NONNEGATIVE)
    moe_experts: int = _f(0, "experts E per Mixture-of-Experts block (0 = dense MLPs); parameter counts in the log "
                          "and MFU count the active parameters (moe_top_k of the E experts per token)",
                          range=NONNEGATIVE)
    moe_top_k: int = _f(2, "experts each token is routed to (at most moe_experts)", range=POSITIVE)
    moe_every: int = _f(1, "every Nth block is MoE (blocks N, 2N, ...); must divide n_layer", range=POSITIVE)
    moe_capacity_factor: float = _f(1.25, "expert capacity per sequence: ceil(top_k x seq_len x factor / experts) "
                                    "token slots; assignments beyond it are dropped (logged as moe_dropped)",
                                    range=POSITIVE)
    moe_aux_coef: float = _f(0.01, "weight of the Switch load-balancing loss in the training objective",
                             range=NONNEGATIVE)
    moe_z_coef: float = _f(0.001, "weight of the router z-loss (mean squared logsumexp of router logits)",
                           range=NONNEGATIVE)
    moe_dispatch: str = _f("capacity", "how tokens reach their experts: capacity (one-hot einsums into "
                           "moe_capacity_factor slots per expert, assignments beyond them dropped) or dropless "
                           "(tokens sorted by expert, grouped GEMMs with ragged_dot, nothing dropped; no fp8)",
                           ("capacity", "dropless"))
    moe_mlp_hidden: int = _f(0, "each routed expert's hidden width (fine-grained experts: narrower than the dense "
                             "MLP); 0 = the dense MLP's (mlp_hidden)", range=NONNEGATIVE)
    moe_shared_experts: int = _f(0, "shared experts every token passes through besides its moe_top_k routed ones "
                                 "(DeepSeek-MoE), run as one dense MLP of moe_shared_experts x the expert width",
                                 range=NONNEGATIVE)
    moe_balance: str = _f("aux", "load balancing: aux (the Switch loss, weighted by moe_aux_coef) or bias "
                          "(DeepSeek-V3's auxiliary-loss-free balancing: a per-expert routing bias, no gradient, "
                          "moved by moe_bias_rate against each step's load; the aux loss is then only logged)",
                          ("aux", "bias"))
    moe_norm_topk: bool = _f(True, "renormalise each token's top-k router probabilities to sum to 1 as its combine "
                             "weights (Mixtral; Qwen3-MoE's norm_topk_prob); false: the softmax probabilities as "
                             "they are")
    moe_bias_rate: float = _f(0.001, "moe_balance=bias: the routing bias of an expert above the mean load falls "
                              "by this much per step, one below it rises by as much", range=POSITIVE)

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def head_dim(self) -> int:
        """K: head_size, or n_embd / n_head when it is 0."""
        return self.head_size or self.n_embd // self.n_head

    def beyond_gpt2(self) -> list[str]:
        """The architecture keys set away from GPT-2's choice, as 'key=value' (empty for a GPT-2)."""
        gpt2 = {"norm": "layernorm", "norm_scale": True, "position": "learned", "mlp": "gelu",
                "mlp_hidden": (0, 4 * self.n_embd), "n_kv_head": (0, self.n_head), "qk_norm": False,
                "tie_embeddings": True, "bias": True, "logit_softcap": 0.0, "norm_eps": 1e-5,
                "head_size": (0, self.n_embd // self.n_head)}
        return [f"model.{k}={getattr(self, k)}" for k, v in gpt2.items()
                if getattr(self, k) not in (v if isinstance(v, tuple) else (v,))]

    def fp8_linears(self) -> frozenset[str]:
        """The block linear kinds (jaxgpt.hlo.BLOCK_LINEARS) that run in fp8: all for true, none for false
        and for an unresolved auto (what auto is without a GPU to cost it on; jaxgpt/gpu/fp8_choice.py
        resolves it for one), else the listed ones."""
        if self.fp8 is True:
            return frozenset(BLOCK_LINEARS)
        if not self.fp8 or self.fp8 == "auto":
            return frozenset()
        return frozenset(self.fp8.split(","))

    @property
    def kv_heads(self) -> int:
        """Key/value heads G (n_kv_head, or n_head when it is 0)."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP hidden width F (mlp_hidden, or 4 x n_embd when it is 0)."""
        return self.mlp_hidden or 4 * self.n_embd

    @property
    def expert_width(self) -> int:
        """Each routed expert's hidden width (moe_mlp_hidden, or the dense MLP's when it is 0)."""
        return self.moe_mlp_hidden or self.mlp_width


@dataclass(frozen=True)
class DataConfig:
    path: str = _f("shakespeare", "'shakespeare' (bundled, prepared on first use) or a dir made by python -m jaxgpt.prepare")
    tokenizer: str = _f("gpt2", "gpt2 (bundled), a Hugging Face tokenizer.json (or a directory holding one) or a "
                        "tiktoken BPE file such as Llama 3's tokenizer.model; data must be prepared with the same one")
    chat: str = _f("", "supervised fine-tuning on chat data, replacing data.path: JSONL or Parquet files, directories "
                   "or globs (comma-separated) of {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}, or "
                   "'bundled' (a generated chat set); the loss counts assistant tokens only (jaxgpt/chat/)")
    chat_template: str = _f("", "data.chat's template: empty = the tokenizer's own (chat_template in "
                            "tokenizer_config.json; GPT-2's: the built-in ChatML-style one), or a Jinja file")
    chat_val_fraction: float = _f(0.05, "data.chat: the fraction of conversations (every 1/f-th) held out for the "
                                  "val loss", range=Range(0, 1, lo_open=True, hi_open=True))
    skip_bad_lines: bool = _f(False, "data.chat: skip (and count) malformed lines and conversations (no role or "
                              "content, a role the template does not know, no assistant turn) instead of refusing")
    mix: str = _f("", "mixture of prepared dirs with weights, e.g. 'web:0.7,code:0.3' (replaces data.path when set)")
    num_threads: int = _f(2, "Grain reader threads per process", range=POSITIVE)
    prefetch: int = _f(4, "batches Grain prepares ahead of the device", range=NONNEGATIVE)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = _f(1e-3, "peak learning rate (after warmup)", range=POSITIVE)
    min_lr_ratio: float = _f(0.1, "final learning rate of the cosine decay, as a fraction of lr", range=UNIT)
    warmup_steps: int = _f(20, "linear warmup steps from 0 to lr", range=NONNEGATIVE)
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay, applied to weight matrices and embeddings only",
                             range=NONNEGATIVE)
    beta1: float = _f(0.9, "AdamW beta1", range=BETA)
    beta2: float = _f(0.95, "AdamW beta2", range=BETA)
    eps: float = _f(1e-8, "AdamW epsilon", range=POSITIVE)
    grad_clip: float = _f(1.0, "clip gradients to this global norm (0 disables)", range=NONNEGATIVE)
    name: str = _f("adamw", "adamw, or muon: Muon for the blocks' weight matrices and AdamW (lr, betas, "
                   "weight_decay above) for embeddings, head, norms, biases and routers", ("adamw", "muon"))
    muon_lr: float = _f(0.02, "Muon's peak learning rate (same warmup and cosine decay as lr)", range=POSITIVE)
    muon_momentum: float = _f(0.95, "Muon's Nesterov momentum", range=BETA)
    muon_weight_decay: float = _f(0.0, "Muon's decoupled weight decay (times muon_lr)", range=NONNEGATIVE)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(300, "optimizer steps to train", range=POSITIVE)
    batch_size: int = _f(16, "global batch in sequences per optimizer step (all devices, all micro-batches)",
                         range=POSITIVE)
    grad_accum: int = _f(1, "micro-batches per optimizer step; batch_size / grad_accum sequences each", range=POSITIVE)
    seed: int = _f(0, "seed for parameters and data order", range=SEED)
    eval_every: int = _f(50, "evaluate val loss every N steps (and at the first and last step); 0 disables",
                         range=NONNEGATIVE)
    eval_batches: int = _f(4, "fixed val batches (of batch_size sequences) per evaluation", range=POSITIVE)
    hang_timeout: float = _f(0.0, "seconds a step or an input wait may take before the run counts as hung: every "
                             "process writes its Python stacks to RUN_DIR/hangs/, names the process the others wait "
                             "for and exits 76 (restartable); 0 = auto: 20 x the median step time once 15 steps ran, "
                             "at least 60 s; -1 = no watchdog", range=Range(0, extra=(-1,)))
    compile_timeout: float = _f(1800.0, "the same bound, in seconds, for what may legitimately take longer than a "
                                "step: start-up (restore, compile) to the end of the first step, an evaluation, a "
                                "checkpoint wait (and for steps while hang_timeout=0 has no median yet)",
                                range=POSITIVE)


@dataclass(frozen=True)
class EvalConfig:
    tasks: str = _f("", "multiple-choice tasks scored at evaluations, 'NAME=PATH,NAME=PATH' (a PATH alone is "
                    "named by its file name; YAML: a mapping NAME: PATH); each a HellaSwag JSONL file or a {context, choices, label} JSONL file")
    task_every: int = _f(0, "score the tasks every N steps (a multiple of train.eval_every), at the first and the "
                         "last evaluation; 0 = at every evaluation", range=NONNEGATIVE)
    task_limit: int = _f(0, "score only the first N examples of each task; 0 = all", range=NONNEGATIVE)


@dataclass(frozen=True)
class MeshConfig:
    pp: int = _f(1, "pipeline-parallel axis size: the layers split into pp stages, micro-batches flowing through "
                 "them (jaxgpt/parallel/pipeline.py); -1 as below", range=MESH_AXIS)
    dp: int = _f(-1, "data-parallel axis size; -1 takes the devices the other axes leave", range=MESH_AXIS)
    fsdp: int = _f(1, "FSDP/ZeRO-3 axis size: parameters, grads and optimizer state sharded; -1 as above",
                   range=MESH_AXIS)
    cp: int = _f(1, "context-parallel axis size: every sequence split over it, causally load-balanced, K/V "
                 "all-gathered for attention (jaxgpt/parallel/context.py); -1 as above", range=MESH_AXIS)
    ep: int = _f(1, "expert-parallel axis size: MoE experts split over it, and the batch elsewhere; -1 as above",
                 range=MESH_AXIS)
    tp: int = _f(1, "tensor-parallel (Megatron) axis size; -1 as above", range=MESH_AXIS)
    allow_tp_across_hosts: bool = _f(False, "permit a tp axis that spans processes (slow: tp talks in every layer)")

    AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")  # the mesh's order: tp varies fastest, then ep, cp; pp slowest


@dataclass(frozen=True)
class PipelineConfig:
    microbatches: int = _f(0, "micro-batches M in flight through the pp stages per gradient-accumulation round, a "
                           "multiple of pp; bubble (pp-1)/(repeats*M+pp-1); 0 = auto: the most, up to 4 x pp, that "
                           "split the round's rows evenly", range=NONNEGATIVE)
    repeats: int = _f(1, "circular (interleaved) schedule: each stage holds this many non-adjacent chunks of layers "
                      "and every micro-batch goes round the pp stages this many times; 1 = GPipe", range=POSITIVE)
    gather_once: bool = _f(True, "with fsdp: all-gather a stage's weights once per round of the schedule (once per "
                           "step unless train.grad_accum > 1) and reduce-scatter their gradients once after it; "
                           "false: gather them for every micro-batch that passes (ZeRO-3 memory, (R*M+S-1)x the "
                           "weight traffic)")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _f(100, "save a checkpoint every N steps (always at the end and on SIGTERM); 0: only then",
                    range=NONNEGATIVE)
    keep: int = _f(3, "keep the newest N checkpoints", range=POSITIVE)
    local_every: int = _f(0, "also save each process's own shards every N steps to host-local storage "
                          "(checkpoint.local_dir); a restart resumes from the newest step complete on every process "
                          "in either tier (jaxgpt/resilience/local_tier.py); 0: off", range=NONNEGATIVE)
    local_dir: str = _f("", "host-local directory for checkpoint.local_every, e.g. /dev/shm/jaxgpt (memory) or a "
                        "local SSD; every process writes its own subdirectory, never read by another host")
    async_save: bool = _f(True, "write checkpoints in the background while training continues")
    init_from: str = _f("", "start a new run from another run's latest checkpoint (its run dir or checkpoints dir)")
    init_params_only: bool = _f(False, "with init_from: take only the parameters (fresh optimizer, step 0, data order)")
    init_from_hf: str = _f("", "start a new run from Hugging Face GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE weights (a dir with config.json + "
                           "model.safetensors)")


@dataclass(frozen=True)
class LoggingConfig:
    every: int = _f(10, "log train metrics every N steps", range=POSITIVE)
    tensorboard: bool = _f(True, "also write the metrics as TensorBoard event files to RUN_DIR/tb/")
    wandb: bool = _f(False, "also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE etc. apply)")
    wandb_project: str = _f("jaxgpt", "W&B project for logging.wandb=true")
    progress: str = _f("auto", "console output: a progress bar on a terminal, else one line per log step (auto); "
                       "or force bar / lines", ("auto", "bar", "lines"))
    profile_steps: str = _f("", "START:STOP: jax.profiler trace of steps START..STOP (inclusive) into RUN_DIR/profile/ "
                            "(process 0; open in TensorBoard's profile plugin or Perfetto); empty: off")

    def __post_init__(self) -> None:
        self.profile_range  # noqa: B018 - a malformed value fails here, when the config is built

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(START, STOP) from `profile_steps`, or None when profiling is off."""
        if not self.profile_steps.strip():
            return None
        start, sep, stop = self.profile_steps.partition(":")
        try:
            first, last = int(start), int(stop)
        except ValueError:
            first = last = 0
        if not sep or not 1 <= first <= last:
            raise UserError(f"logging.profile_steps must be START:STOP with 1 <= START <= STOP, e.g. 10:12; "
                            f"got {_short(self.profile_steps)}")
        return first, last


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def sections() -> dict[str, type]:
    """Section name -> its dataclass ('model' -> ModelConfig, ...)."""
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}


def all_keys() -> dict[str, dataclasses.Field]:
    """Every valid dotted key ('model.n_layer', ...) with its dataclass field."""
    return {f"{s}.{f.name}": f for s, cls in sections().items() for f in dataclasses.fields(cls)}


def _nearest(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5) if len(key) <= 200 else []
    return f"; did you mean '{close[0]}'?" if close else ""


# What nanoGPT, nanochat, torchtitan and MaxText call some of our keys (the part after the section)
OTHER_NAMES = {"learning_rate": "optimizer.lr", "lr_min": "optimizer.min_lr_ratio",
               "warmup_iters": "optimizer.warmup_steps", "warmup": "optimizer.warmup_steps",
               "max_iters": "train.steps", "max_steps": "train.steps", "num_iterations": "train.steps",
               "training_steps": "train.steps", "block_size": "model.seq_len", "max_seq_len": "model.seq_len",
               "seq_length": "model.seq_len", "max_target_length": "model.seq_len",
               "gradient_accumulation_steps": "train.grad_accum", "grad_accum_steps": "train.grad_accum",
               "eval_interval": "train.eval_every", "eval_iters": "train.eval_batches",
               "log_interval": "logging.every", "grad_clip_norm": "optimizer.grad_clip",
               "max_norm": "optimizer.grad_clip", "n_heads": "model.n_head", "n_layers": "model.n_layer",
               "dim": "model.n_embd", "emb_dim": "model.n_embd", "num_experts": "model.moe_experts",
               "checkpoint_interval": "checkpoint.every", "head_dim": "model.head_size",
               "rms_norm_eps": "model.norm_eps", "norm_topk_prob": "model.moe_norm_topk"}


def _nearest_key(key: str, keys) -> str:
    """'; did you mean ...?' for an unknown dotted key: a close name in its own section, else the
    same or a close name in another ('train.lr' -> 'optimizer.lr') or the key another trainer's
    name stands for ('learning_rate'), else the closest spelling of the whole key."""
    section, _, name = key.rpartition(".")
    own = {k.rsplit(".", 1)[-1]: k for k in keys if k.startswith(section + ".")}
    anywhere = {**OTHER_NAMES, **{k.rsplit(".", 1)[-1]: k for k in reversed(list(keys))}}
    for names in (own, anywhere):
        if close := difflib.get_close_matches(name, list(names), n=1, cutoff=0.75) if len(name) <= 200 else []:
            return f"; did you mean '{names[close[0]]}'?"
    return _nearest(key, keys)


def _coerce(key: str, raw: Any, f: dataclasses.Field) -> Any:
    """Turn a YAML/CLI value into the field's type, or explain why it cannot be."""
    want = type(f.default)
    if words := f.metadata.get("words"):  # a key of its own forms (model.fp8)
        return words(key, raw)
    if isinstance(raw, (list, dict)) and any(v is None for v in (raw.values() if isinstance(raw, dict) else raw)):
        raise UserError(f"config key '{key}' holds an empty (null) entry: {_short(raw)}")
    if key == "data.mix" and isinstance(raw, list):  # YAML list form: [{web: 0.7}, {code: 0.3}] or ["web:0.7", ...]
        raw = ",".join(",".join(f"{k}:{v}" for k, v in item.items()) if isinstance(item, dict) else str(item)
                       for item in raw)
    if key == "eval.tasks" and isinstance(raw, dict):  # YAML mapping form: {hellaswag: path, ...}
        raw = ",".join(f"{k}={v}" for k, v in raw.items())
    if key == "eval.tasks" and isinstance(raw, list):  # or a list of NAME=PATH strings
        raw = ",".join(str(item) for item in raw)
    try:  # a command-line value as a YAML file's would be read (jaxgpt.files.load_yaml: decimal numbers)
        value = files.load_yaml(raw) if isinstance(raw, str) and want is not str else raw
    except yaml.YAMLError as e:
        raise UserError(f"config key '{key}' wants {'an' if want is int else 'a'} {want.__name__}, got {_short(raw)} "
                        f"(not a YAML value: {str(e).splitlines()[0][:100]})") from None
    if want in (int, float) and isinstance(value, str):
        try:  # '1_000'
            value = want(value)
        except ValueError:
            pass
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if type(value) is not want:
        raise UserError(f"config key '{key}' wants {'an' if want is int else 'a'} {want.__name__}, got {_short(raw)}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"config key '{key}' must be one of {', '.join(choices)}; got {_short(value)}{_nearest(value, choices)}")
    _check_range(key, value, f)
    return value


def _short(value: Any) -> str:
    """repr(value), bounded: a YAML alias bomb is a few hundred bytes that nest into gigabytes."""
    short = reprlib.Repr()  # attributes, not keywords: Python 3.11's Repr takes none
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 3, 60, 60, 4, 4
    return short.repr(value)


def _check_range(key: str, value: Any, f: dataclasses.Field) -> None:
    allowed = f.metadata.get("range")
    if allowed is not None and value not in allowed:
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        raise UserError(f"{key} must be {finite}{allowed}, got {value!r}")
    if type(value) is int and abs(value) >= 2**31 and (allowed is None or allowed.hi == math.inf):
        raise UserError(f"{key} must be below 2**31, got {value}")  # steps and sizes are int32 on the device


def _apply(cfg: Config, flat: dict[str, Any], source: str) -> Config:
    keys = all_keys()
    updates: dict[str, dict[str, Any]] = {}
    for key, raw in flat.items():
        if key not in keys:
            raise UserError(f"unknown config key '{key}' in {source}{_nearest_key(key, keys)}")
        section, name = key.split(".", 1)
        updates.setdefault(section, {})[name] = _coerce(key, raw, keys[key])
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in updates.items()})


def from_dict(tree: Any, source: str) -> Config:
    """A Config from a stored {section: {key: value}} (a checkpoint's config item), every value
    type- and range-checked as a YAML file's are (UserError naming `source`); keys this version no
    longer has are dropped, so older checkpoints still read."""
    keys = all_keys()
    return _apply(Config(), {k: v for k, v in _flatten_yaml(tree, source).items() if k in keys}, source)


def _flatten_yaml(tree: Any, source: str) -> dict[str, Any]:
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UserError(f"{source} must hold sections such as 'model:' and 'train:', not a {type(tree).__name__}")
    flat = {}
    for section, body in tree.items():
        if not isinstance(body, dict):
            raise UserError(f"section '{section}' in {source} must map keys to values"
                            f"{'' if section in sections() else _nearest(str(section), sections())}")
        for k, v in body.items():
            flat[f"{section}.{k}"] = v
    return flat


def resolve_config_path(name_or_path: str | None) -> Path:
    if name_or_path is None:
        name_or_path = DEFAULT_CONFIG
    if not name_or_path.strip():
        raise UserError("--config must not be empty: give a YAML path or a bundled config's name")
    path = Path(name_or_path)
    if path.exists() and not path.is_file():
        files.require_file(path, "config file")  # says what it is instead
    if not path.is_file():
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        bundled = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise UserError(f"config file '{name_or_path}' not found (bundled configs: {', '.join(bundled)})")
    return path


def load_config(config: str | None = None, overrides: list[str] = (), mesh: str | None = None) -> Config:
    """Defaults <- YAML file <- `--mesh` <- `section.key=value` overrides."""
    cfg = Config()  # the defaults are the shakespeare run, so it works without configs/ too
    if config is not None or (CONFIG_DIR / f"{DEFAULT_CONFIG}.yaml").is_file():
        path = resolve_config_path(config)
        try:
            tree = files.load_yaml(files.read_text(path, "config file"))
        except yaml.YAMLError as e:
            raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        cfg = _apply(cfg, _flatten_yaml(tree, str(path)), str(path))
    if mesh is not None:
        cfg = _apply(cfg, parse_mesh(mesh), "--mesh")
    flat = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override '{item}' is not of the form section.key=value")
        flat[key.strip()] = value
    return _apply(cfg, flat, "the command line")


def parse_mesh(spec: str) -> dict[str, str]:
    """'dp=2,tp=4' -> {'mesh.pp': '1', 'mesh.dp': '2', 'mesh.fsdp': '1', 'mesh.ep': '1', 'mesh.tp': '4'}: axes
    not named are 1."""
    axes = list(MeshConfig.AXES)
    out, named = {f"mesh.{a}": "1" for a in axes}, set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, size = (x.strip() for x in part.partition("="))
        if not sep:
            raise UserError(f"--mesh '{spec}': '{part}' is not of the form axis=size (axes: {', '.join(axes)})")
        if name not in axes:
            raise UserError(f"--mesh '{spec}': unknown axis '{name}'{_nearest(name, axes)} (axes: {', '.join(axes)})")
        if name in named:
            raise UserError(f"--mesh '{spec}': axis '{name}' is given twice")
        named.add(name)
        out[f"mesh.{name}"] = size
    return out


def mesh_shape(mesh: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 and check that the axes multiply to the device count."""
    sizes = {a: getattr(mesh, a) for a in MeshConfig.AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise UserError(f"mesh: only one axis may be -1, got {', '.join(free)}")
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise UserError(f"mesh: axis '{bad[0]}' has size {sizes[bad[0]]}; sizes are positive (or -1 for the rest)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % fixed:
            raise UserError(f"mesh: the fixed axes multiply to {fixed}, which does not divide the {n_devices} devices")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        layout = ",".join(f"{a}={s}" for a, s in sizes.items())
        raise UserError(f"mesh {layout} has {math.prod(sizes.values())} devices but {n_devices} are available")
    return sizes


def validate(cfg: Config, n_devices: int, data_vocab_size: int | None = None) -> dict[str, int]:
    """Every check that can fail before compilation; returns the resolved mesh shape."""
    m, t = cfg.model, cfg.train
    for key, f in all_keys().items():  # load_config checked these already; a Config built in code was not
        section, name = key.split(".", 1)
        _check_range(key, getattr(getattr(cfg, section), name), f)
    sizes = mesh_shape(cfg.mesh, n_devices)
    if m.loss_chunk and m.seq_len % m.loss_chunk:
        raise UserError(f"model.loss_chunk={m.loss_chunk} does not divide model.seq_len={m.seq_len}")
    if m.n_embd % m.n_head and not m.head_size:
        raise UserError(f"model.n_head={m.n_head} does not divide model.n_embd={m.n_embd}")
    if cfg.checkpoint.local_every and not cfg.checkpoint.local_dir.strip():
        raise UserError(f"checkpoint.local_every={cfg.checkpoint.local_every} needs checkpoint.local_dir, a host-local "
                        f"directory such as /dev/shm/jaxgpt or a local SSD")
    if t.batch_size % t.grad_accum:
        raise UserError(f"train.grad_accum={t.grad_accum} does not divide train.batch_size={t.batch_size}")
    if t.batch_size * m.seq_len >= 2**31:  # the loss and token counts are int32 on the device
        raise UserError(f"train.batch_size x model.seq_len = {t.batch_size * m.seq_len:,} tokens per step must be "
                        f"below 2**31")
    micro, batch_ways = t.batch_size // t.grad_accum, sizes["dp"] * sizes["fsdp"] * sizes["ep"]
    if micro % batch_ways:
        raise UserError(f"the micro-batch of {micro} sequences (train.batch_size / train.grad_accum) "
                        f"does not split over dp x fsdp x ep = {batch_ways} devices")
    if m.moe_experts:
        if m.moe_top_k > m.moe_experts:
            raise UserError(f"model.moe_top_k={m.moe_top_k} exceeds model.moe_experts={m.moe_experts}")
        if m.moe_experts % sizes["ep"]:
            raise UserError(f"the ep axis ({sizes['ep']}) does not divide model.moe_experts={m.moe_experts}")
        if m.n_layer % m.moe_every:
            raise UserError(f"model.moe_every={m.moe_every} does not divide model.n_layer={m.n_layer}")
        if sizes["cp"] > 1 and m.moe_dispatch == "capacity":
            raise UserError("cp reorders each window's tokens (an early and a late chunk per device), which changes "
                            "which tokens model.moe_dispatch=capacity drops when an expert overflows; use "
                            "model.moe_dispatch=dropless with cp")
        if m.moe_dispatch == "dropless" and m.fp8_linears() & {"expert_in", "expert_gate", "expert_out"}:
            raise UserError("model.moe_dispatch=dropless runs its experts as ragged_dot grouped GEMMs, which have "
                            "no fp8 form here; set model.fp8=false or model.moe_dispatch=capacity")
    if m.fp8_head and (m.ops == "reference" or m.ops not in OPS_FORMS and "fused_loss" not in m.ops.split(",")):
        raise UserError("model.fp8_head runs inside the fused loss: it needs model.ops=tuned or auto (or a list "
                        "with fused_loss)")
    if m.attention == "mosaic" and (m.document_mask or sizes["cp"] > 1):
        raise UserError("model.attention=mosaic runs plain causal attention only, not with "
                        f"{'model.document_mask' if m.document_mask else 'cp'}; use model.attention=auto or cudnn")
    if m.attention == "mosaic" and (manual := [a for a in ("pp", "dp", "ep") if sizes[a] > 1]):
        raise UserError(f"model.attention=mosaic cannot run with {manual[0]}={sizes[manual[0]]}: tokamax's kernels do "
                        "not differentiate inside the train step's per-shard loop (jaxgpt/lowering/flash.py); split "
                        "the batch with fsdp instead of dp, or use model.attention=auto or cudnn")
    if m.n_head % m.kv_heads:
        raise UserError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head} (each key/value head "
                        f"serves n_head / n_kv_head query heads)")
    if cfg.data.chat and cfg.data.mix:
        raise UserError("data.chat and data.mix are both set; fine-tune on chat data (data.chat) or train on a "
                        "mixture (data.mix), not both")
    if cfg.data.chat and cfg.checkpoint.init_from and not cfg.checkpoint.init_params_only:
        raise UserError("data.chat fine-tunes another run's parameters: set checkpoint.init_params_only=true (that "
                        "run's optimizer state, step and data position belong to its own data)")
    if cfg.data.chat and not m.document_mask:
        raise UserError("data.chat packs several conversations into each window: set model.document_mask=true so "
                        "that none sees another")
    if m.document_mask and m.document_token >= m.vocab_size:
        raise UserError(f"model.document_token={m.document_token} is past model.vocab_size={m.vocab_size}; set it to "
                        f"the tokenizer's document separator")
    if m.position_reset and not (m.document_mask and m.position == "rope"):
        raise UserError("model.position_reset restarts rotary positions at each document: it needs "
                        "model.document_mask=true and model.position=rope (learned positions index the window)")
    if m.position == "rope" and m.head_dim % 2:
        raise UserError(f"model.position=rope rotates pairs of features, but the head dim (model.head_size, or "
                        f"n_embd / n_head) = {m.head_dim} is odd")
    _validate_eval(cfg, sizes)
    # ep > 1 with a dense model is allowed: ep then only splits the batch, like a dp axis.
    pipeline_microbatches(cfg, sizes)  # raises if the pipeline layout cannot work
    if m.n_head % sizes["tp"]:
        raise UserError(f"model.n_head={m.n_head} is not divisible by the tp axis ({sizes['tp']})")
    if m.kv_heads % sizes["tp"]:
        raise UserError(f"model.n_kv_head={m.kv_heads} is not divisible by the tp axis ({sizes['tp']}): tp splits "
                        f"the key/value heads like the query heads (it does not replicate them)")
    if m.padded_vocab % sizes["tp"] or m.mlp_width % sizes["tp"]:
        raise UserError(f"tp={sizes['tp']} must divide the padded vocabulary ({m.padded_vocab}) "
                        f"and the MLP width ({m.mlp_width})")
    if m.n_embd % sizes["fsdp"]:
        raise UserError(f"fsdp={sizes['fsdp']} must divide model.n_embd={m.n_embd}")
    if m.seq_len % (2 * sizes["cp"]):
        raise UserError(f"cp={sizes['cp']} needs model.seq_len={m.seq_len} to split into 2 x cp = {2 * sizes['cp']} "
                        f"equal chunks (each device holds an early and a late one)")
    if data_vocab_size is not None and data_vocab_size > m.vocab_size:
        raise UserError(f"the data's tokenizer has {data_vocab_size} tokens but model.vocab_size is "
                        f"{m.vocab_size}; raise model.vocab_size to at least {data_vocab_size}")
    return sizes


def _validate_eval(cfg: Config, sizes: dict[str, int]) -> None:
    from jaxgpt.evaluate.tasks import parse_spec  # the spec's syntax; the files are read by train()

    e, every = cfg.eval, cfg.train.eval_every
    if not parse_spec(e.tasks):
        return
    if not every:
        raise UserError("eval.tasks are scored at evaluations, but train.eval_every=0 turns them off")
    if e.task_every % every:
        raise UserError(f"eval.task_every={e.task_every} is not a multiple of train.eval_every={every} (tasks are "
                        f"scored at evaluations)")
    if sizes["pp"] > 1:
        raise UserError(f"eval.tasks: task scoring does not pipeline (pp={sizes['pp']}); score the checkpoints with "
                        f"python -m jaxgpt.evaluate instead")


def round_rows(cfg: Config, sizes: dict[str, int]) -> int:
    """Sequences of one data shard in one gradient-accumulation round (what a pipeline splits into M)."""
    return cfg.train.batch_size // cfg.train.grad_accum // (sizes["dp"] * sizes["fsdp"] * sizes["ep"])


def pipeline_microbatches(cfg: Config, sizes: dict[str, int]) -> int:
    """Micro-batches M per pipeline round (pipeline.microbatches, or its auto rule), after checking
    that the layers split into pp x repeats chunks and the round's rows into M x (dp*fsdp*ep);
    1 without pipelining."""
    S, R, m = sizes["pp"], cfg.pipeline.repeats, cfg.model
    if S == 1:
        for key, value, default in (("repeats", R, 1), ("microbatches", cfg.pipeline.microbatches, 0)):
            if value != default:
                raise UserError(f"pipeline.{key}={value} needs a pp axis (--mesh pp=S,...); with pp=1 there is "
                                f"no pipeline")
        return 1
    if m.n_layer % (S * R):
        raise UserError(f"model.n_layer={m.n_layer} does not split into pp x pipeline.repeats = {S} x {R} = "
                        f"{S * R} equal chunks of layers")
    if m.moe_experts and (m.n_layer // m.moe_every) % (S * R):
        raise UserError(f"the {m.n_layer // m.moe_every} MoE groups (model.n_layer / model.moe_every, a group ending "
                        f"in its MoE block) do not split into pp x pipeline.repeats = {S} x {R} = {S * R} equal "
                        f"chunks; pick a moe_every that leaves a multiple of {S * R} groups")
    rows = round_rows(cfg, sizes)
    M = cfg.pipeline.microbatches
    if M == 0:
        fits = [k for k in range(S, 4 * S + 1, S) if rows % k == 0]
        if not fits:
            raise UserError(f"pp={S} needs a multiple of {S} micro-batches, but a data shard's {rows} sequences "
                            f"per round (train.batch_size / train.grad_accum / (dp x fsdp x ep)) split into none; "
                            f"raise train.batch_size or set pipeline.microbatches")
        return max(fits)
    if M % S:
        raise UserError(f"pipeline.microbatches={M} is not a multiple of pp={S} (each stage computes the head "
                        f"and loss of M/pp of them)")
    if rows % M:
        raise UserError(f"pipeline.microbatches={M} does not divide a data shard's {rows} sequences per round "
                        f"(train.batch_size / train.grad_accum / (dp x fsdp x ep))")
    return M


def key_help() -> list[tuple[str, Any, str, str, str]]:
    """(key, default, meaning, choices as 'a|b' or '', range as '> 0' or '') for every config key:
    what --help prints and scripts/config_reference.py writes to docs/config.md."""
    rows = []
    for key, f in all_keys().items():
        choices = f.metadata.get("choices")
        allowed = f.metadata.get("range")
        rows.append((key, f.default, f.metadata["doc"], "|".join(choices) if choices and len(choices) > 1 else "",
                     str(allowed) if allowed is not None and allowed != Range() else ""))
    return rows


def help_text() -> str:
    lines = ["config keys (set in a YAML file or as section.key=value):"]
    for key, default, doc, choices, allowed in key_help():
        extra = (f" [{choices}]" if choices else "") + (f" ({allowed})" if allowed else "")
        lines.append(f"  {key:<26} = {default!s:<12} {doc}{extra}")
    return "\n".join(lines)
