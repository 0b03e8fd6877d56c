"""By hand (needs torch + transformers): the HF export generates what `jaxgpt.sample` generates.

    python scripts/hf_greedy_check.py RUN_DIR [--prompt TEXT] [--max-new-tokens N]

Exports RUN_DIR's newest checkpoint to a temporary directory, loads it with `AutoTokenizer` and
`AutoModelForCausalLM` (`GPT2LMHeadModel` or `LlamaForCausalLM`, as config.json says) exactly as
a user would, generates greedily, and compares the text with `python -m jaxgpt.sample RUN_DIR
--temperature 0`. Exits 1 when they differ (HF stops at an <|endoftext|> that the model emits, as
generation_config.json says, and sample does not: such a model differs from there on). torch is
not a jaxgpt dependency (not even for tests), so this is a manual check; the test suite checks
the tokenizer always, and the logits (and, for Llama, this greedy text) where torch is installed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = [sys.executable, "-m"]
    ours = subprocess.run(run + ["jaxgpt.sample", args.run_dir, "--prompt", args.prompt, "--temperature", "0",
                                 "--max-new-tokens", str(args.max_new_tokens)],
                          capture_output=True, text=True, check=True).stdout.removesuffix("\n")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(run + ["jaxgpt.hf", "export", args.run_dir, out], check=True, capture_output=True)
        tokenizer = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.eos_token_id)
    theirs = tokenizer.decode(generated[0])
    print(f"jaxgpt.sample: {ours!r}\ntransformers ({type(model).__name__}): {theirs!r}")
    same = ours == theirs
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
