"""Hugging Face interop: `python -m jaxgpt.hf export RUN_DIR OUT_DIR`, `import HF_DIR RUN_DIR`, `check HF_DIR`.

Three transformers classes hold jaxgpt models: `GPT2LMHeadModel` a GPT-2-shaped one (every
architecture key at its default), `LlamaForCausalLM` a Llama-shaped one (RMSNorm with a scale,
RoPE, SwiGLU; any grouped-query heads, MLP width, rope_theta, tied or untied head, biases or not),
`MixtralForCausalLM` a Llama-shaped Mixture-of-Experts one (experts in every block, top-k routing).
`classes.architecture` picks the class from the model config on export and refuses in one line
what none holds (train and plan call it, through `check_init_from_hf`, before compiling; config.py
does not reach up into hf/); on the way in, config.json's model_type (or its `architectures`) picks it.

    cli.py        the command line
    classes.py    which class holds a model config, or one line saying why none does
    convert.py    HF directory <-> run: read and check, export, import, load for checkpoint.init_from_hf
    gpt2.py       GPT-2's tensor mapping and config.json (the parameter table in its docstring)
    llama.py      Llama's tensor mapping, config.json and RoPE layout; what Llama cannot hold
    mixtral.py    Mixtral's: Llama's attention with experts (their mapping and config.json keys)
    weights.py    an HF checkpoint's tensors taken by name, shapes checked (every mapping)
    tokenizer.py  GPT-2's HF tokenizer files, built from the packaged vocabulary
"""

from jaxgpt.hf.cli import main
from jaxgpt.hf.convert import (CONFIG, EXPORT_FILES, GENERATION_CONFIG, WEIGHTS, check_dir, export, generation_config,
                               import_dir, load_dir, read_dir, restore_params)
from jaxgpt.hf.classes import architecture, check_init_from_hf

__all__ = ["CONFIG", "EXPORT_FILES", "GENERATION_CONFIG", "WEIGHTS", "architecture", "check_dir", "check_init_from_hf", "export",
           "generation_config", "import_dir", "load_dir", "main", "read_dir", "restore_params"]
