"""Which transformers class holds a jaxgpt model: GPT-2, Llama or Mixtral, or one line saying why none does."""

from __future__ import annotations

from jaxgpt.config import Config, ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.hf import llama, mixtral


def architecture(m: ModelConfig) -> str:
    """'gpt2', 'llama' or 'mixtral' (convert.FORMATS' keys); a one-line UserError if no class holds `m`."""
    if m.moe_experts:
        if blockers := mixtral.blockers(m):
            raise UserError(f"no Hugging Face class holds this Mixture-of-Experts model: MixtralForCausalLM "
                            f"cannot, for {', '.join(blockers)}")
        return "mixtral"
    if not m.beyond_gpt2():
        return "gpt2"
    if blockers := llama.blockers(m):
        raise UserError(f"no Hugging Face class holds this model: LlamaForCausalLM cannot, for "
                        f"{', '.join(blockers)}; nor can GPT2LMHeadModel, for {', '.join(m.beyond_gpt2())}")
    return "llama"


def check_init_from_hf(cfg: Config) -> None:
    """Before compiling (train, plan): a run with checkpoint.init_from_hf must be a model a Hugging
    Face class holds; one UserError line naming the keys none does (`architecture`)."""
    if cfg.checkpoint.init_from_hf:
        architecture(cfg.model)
