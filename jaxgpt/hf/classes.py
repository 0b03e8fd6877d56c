"""Which transformers class holds a jaxgpt model: GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE, or one line saying why none does."""

from __future__ import annotations

from jaxgpt.config import Config, ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.hf import llama, mixtral, qwen3


def architecture(m: ModelConfig) -> str:
    """'gpt2', 'llama', 'qwen3', 'mixtral' or 'qwen3_moe' (convert.FORMATS' keys); a one-line UserError
    if no class holds `m`."""
    if m.moe_experts:
        if not (blockers := mixtral.blockers(m)):
            return "mixtral"
        if not (qwen := qwen3.moe_blockers(m)):
            return "qwen3_moe"
        raise UserError(f"no Hugging Face class holds this Mixture-of-Experts model: MixtralForCausalLM "
                        f"cannot, for {', '.join(blockers)}; nor can Qwen3MoeForCausalLM, for {', '.join(qwen)}")
    if not m.beyond_gpt2():
        return "gpt2"
    if not (blockers := llama.blockers(m)):
        return "llama"
    if not (qwen := qwen3.blockers(m)):
        return "qwen3"
    raise UserError(f"no Hugging Face class holds this model: LlamaForCausalLM cannot, for "
                    f"{', '.join(blockers)}; nor can GPT2LMHeadModel, for {', '.join(m.beyond_gpt2())}; nor can "
                    f"Qwen3ForCausalLM, for {', '.join(qwen)}")


def check_init_from_hf(cfg: Config) -> None:
    """Before compiling (train, plan): a run with checkpoint.init_from_hf must be a model a Hugging
    Face class holds (`architecture`), and a directory with its own tokenizer must be the run's
    data.tokenizer; one UserError line naming what differs."""
    if not cfg.checkpoint.init_from_hf:
        return
    architecture(cfg.model)
    from pathlib import Path

    from jaxgpt import tokenizer

    source = Path(cfg.checkpoint.init_from_hf)
    if not (source / tokenizer.HF_FILE).is_file():
        return  # weights alone: the run's data.tokenizer is the user's word
    theirs, ours = tokenizer.load(str(source)), tokenizer.load(cfg.data.tokenizer)
    if theirs.sha256 != ours.sha256:
        raise UserError(f"checkpoint.init_from_hf {source} comes with its own tokenizer ({theirs.describe()}), not "
                        f"data.tokenizer's ({ours.describe()}); set data.tokenizer={source}")
