"""A PyTorch reference for jaxgpt's CPU speed (issue 23): the same GPT-2, batch, data and optimizer.

    /path/to/torch-env/bin/python scripts/torch_reference.py                 # eager, then compiled
    /path/to/torch-env/bin/python scripts/torch_reference.py --mode compiled --steps 10 --json ref.json
    /path/to/torch-env/bin/python scripts/torch_reference.py train.batch_size=8   # jaxgpt overrides

torch is an optional benchmark dependency: the product and the tests never import it. The script
needs torch and jaxgpt in one environment (`pip install torch` beside `pip install -e .`): the
config, the data and the batches are jaxgpt's own, so the two sides cannot drift apart.

What is the same as `python -m jaxgpt.train` (and `scripts/benchmark.py`):
    config     jaxgpt's (`jaxgpt.config.load_config`: the defaults, --config, overrides); only
               GPT-2 models (no MoE, no model.* architecture options beyond GPT-2)
    model      pre-LayerNorm GPT-2 blocks (eps 1e-5, biases), tanh-GELU MLP of 4D, causal
               attention (`scaled_dot_product_attention`, PyTorch's fused CPU kernel), learned
               positions, the head tied to wte; wte padded to a multiple of 128 rows as in jaxgpt,
               whose padding logits are -inf: here they are not computed (the same loss, and the
               padded rows get no gradient from the head either);
               GPT-2's init (normal 0.02, residual projections 0.02/sqrt(2L), zero biases).
               The parameter count printed must equal `jaxgpt.model.param_count`.
    data       the bundled tiny shakespeare (r50k_base tokens) or data.path, batches from
               `jaxgpt.data.train_iterator` with the same seed: the same windows in the same order
    optimizer  AdamW (betas, eps, weight decay on matrices and embeddings only), global-norm
               clipping, linear warmup + cosine decay to min_lr_ratio (optax's schedule), fp32
    timing     batches read before timing; each step (forward, backward, clip, AdamW, schedule)
               timed alone after --warmup steps; the median of --steps steps, p10 and p90, and the
               median process CPU time per step (all threads; steadier than wall time under load)

Modes: `eager`, and `compiled` (`torch.compile` of the model's forward + loss, as nanoGPT does;
the optimizer stays eager, fused where torch has a fused CPU AdamW). Prints one JSON object per
mode and a markdown row:
| reference | threads | step ms (p10-p90) | tokens/s | loss first/last |
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jaxgpt import data
from jaxgpt.config import load_config
from jaxgpt.model import param_count


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it, from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Block(nn.Module):
    def __init__(self, D: int, H: int, L: int):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(D, eps=1e-5), nn.LayerNorm(D, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.c_fc, self.mlp_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        for lin in (self.c_attn, self.attn_proj, self.c_fc, self.mlp_proj):
            std = 0.02 / math.sqrt(2 * L) if lin in (self.attn_proj, self.mlp_proj) else 0.02
            nn.init.normal_(lin.weight, std=std)
            nn.init.zeros_(lin.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        qkv_BT3HK = self.c_attn(self.ln_1(x_BTD)).view(B, T, 3, self.H, D // self.H)
        q_BHTK, k_BHTK, v_BHTK = qkv_BT3HK.permute(2, 0, 3, 1, 4).unbind(0)
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        x_BTD = x_BTD + self.attn_proj(y_BHTK.transpose(1, 2).reshape(B, T, D))
        return x_BTD + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x_BTD)), approximate="tanh"))


class GPT(nn.Module):
    """jaxgpt's GPT-2 (module docstring); forward returns the mean next-token cross-entropy."""

    def __init__(self, m):
        super().__init__()
        self.vocab_size = m.vocab_size
        self.wte = nn.Parameter(0.02 * torch.randn(m.padded_vocab, m.n_embd))
        self.wpe = nn.Parameter(0.02 * torch.randn(m.seq_len, m.n_embd))
        self.blocks = nn.ModuleList(Block(m.n_embd, m.n_head, m.n_layer) for _ in range(m.n_layer))
        self.ln_f = nn.LayerNorm(m.n_embd, eps=1e-5)

    def forward(self, tokens_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = self.wte[tokens_BT] + self.wpe[: tokens_BT.shape[1]]
        for block in self.blocks:
            x_BTD = block(x_BTD)
        # The padding rows' logits would be -inf (no probability, no gradient): leaving them out is
        # the same loss and gradient without a masked copy of the [B, T, V] logits.
        logits_BTV = self.ln_f(x_BTD) @ self.wte[: self.vocab_size].T
        return F.cross_entropy(logits_BTV.flatten(0, 1), labels_BT.flatten())


def lr_at(step: int, o, total_steps: int) -> float:
    """optax.warmup_cosine_decay_schedule as jaxgpt.optim.lr_schedule builds it."""
    warmup = min(o.warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return o.lr * step / warmup
    decay = max(total_steps, warmup + 1) - warmup
    progress = min(step - warmup, decay) / decay
    end = o.lr * o.min_lr_ratio
    return end + (o.lr - end) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: GPT, o) -> torch.optim.Optimizer:
    """AdamW with decay on weight matrices and embeddings (jaxgpt.optim.decay_mask), none on biases and norms."""
    decay = [p for n, p in model.named_parameters() if n in ("wte", "wpe") or (n.endswith("weight") and p.dim() == 2)]
    rest = [p for n, p in model.named_parameters() if all(p is not q for q in decay)]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)  # torch >= 2.4 has a fused CPU AdamW
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


def run(cfg, mode: str, batches: list[np.ndarray], steps: int, warmup: int) -> dict:
    m, o, t = cfg.model, cfg.optimizer, cfg.train
    torch.manual_seed(t.seed)
    model = GPT(m)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != param_count(m):
        raise SystemExit(f"error: the torch model has {n_params:,} parameters, jaxgpt's {param_count(m):,}")
    opt = make_optimizer(model, o)
    loss_fn = torch.compile(model) if mode == "compiled" else model
    times, cpu, losses = [], [], []
    t_first = time.perf_counter()
    for i, batch in enumerate(batches):
        x = torch.from_numpy(batch)
        cpu0, t0 = _cpu_s(), time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(i, o, t.steps)
        loss = loss_fn(x[:, :-1], x[:, 1:].long())
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(_cpu_s() - cpu0)
        elif i == warmup - 1:
            warmup_s = time.perf_counter() - t_first
        losses.append(loss.item())
    step_s = float(np.median(times))
    tokens_per_step = t.batch_size * m.seq_len
    return {
        "reference": f"torch {mode}", "torch": torch.__version__, "python": platform.python_version(),
        "cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
        "optimizer": "AdamW fused" if opt.defaults.get("fused") else "AdamW foreach",
        "parameters": n_params, "tokens_per_step": tokens_per_step, "steps": steps, "warmup": warmup,
        "warmup_s": warmup_s if warmup else 0.0,
        "step_ms": {"median": 1e3 * step_s, "p10": 1e3 * float(np.percentile(times, 10)),
                    "p90": 1e3 * float(np.percentile(times, 90)), "min": 1e3 * min(times), "max": 1e3 * max(times)},
        "cpu_ms_per_step": 1e3 * float(np.median(cpu)),  # process CPU time, all threads
        "tokens_per_sec": tokens_per_step / step_s, "loss_first_last": [losses[0], losses[-1]],
        "date": datetime.date.today().isoformat(),
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def markdown_row(r: dict) -> str:
    ms = r["step_ms"]
    return (f"| {r['reference']} | {r['threads']} | {ms['median']:,.1f} ({ms['p10']:,.1f}-{ms['p90']:,.1f}) | "
            f"{r['tokens_per_sec']:,.0f} | {r['loss_first_last'][0]:.3f} / {r['loss_first_last'][1]:.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/torch_reference.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML file, or the name of one in configs/ (default: shakespeare)")
    parser.add_argument("--mode", choices=("eager", "compiled", "both"), default="both")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiling included; default 2)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, one per core)")
    parser.add_argument("--json", type=Path, help="append the results to this file, one JSON object a line")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="jaxgpt config overrides")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be positive")
    cfg = load_config(args.config, args.overrides, None)
    m, t = cfg.model, cfg.train
    if m.beyond_gpt2() or m.moe_experts or m.fp8_linears() or m.remat not in ("none", "auto") or t.grad_accum != 1:
        parser.error("the reference is GPT-2 only: no MoE, fp8, remat, grad_accum or model.* beyond GPT-2 "
                     f"({' '.join(m.beyond_gpt2()) or 'see the config'})")
    if m.dtype == "bfloat16":
        parser.error("the reference runs in fp32, as jaxgpt does on a CPU (model.dtype=auto)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = data.load_split(data.resolve_data_dir(cfg.data.path), "train")
    feed = data.train_iterator(tokens, seq_len=m.seq_len, global_batch=t.batch_size, seed=t.seed,
                               process_index=0, process_count=1)
    batches = [np.asarray(next(feed)) for _ in range(args.warmup + args.steps)]
    del feed
    modes = ("eager", "compiled") if args.mode == "both" else (args.mode,)
    print(f"# {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{param_count(m) / 1e6:.2f}M parameters, {t.batch_size} x {m.seq_len} tokens/step", flush=True)
    for mode in modes:
        result = run(cfg, mode, batches, args.steps, args.warmup)
        print(json.dumps(result), flush=True)
        print(markdown_row(result), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
