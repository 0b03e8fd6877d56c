"""A Hugging Face checkpoint's tensors, taken by name with their shapes checked: what the GPT-2
(gpt2.py) and Llama (llama.py) imports share. Every tensor must be taken exactly once, so a
missing, misshapen or unexpected one is a one-line UserError naming it (and, where the shape
tells, the model.* setting that would fit)."""

from __future__ import annotations

import re

import numpy as np

from jaxgpt.errors import UserError


class Tensors:
    def __init__(self, tensors: dict[str, np.ndarray], layer_prefix: str, n_layer: int):
        """tensors: {name: array} without any outer prefix; layer_prefix: the per-layer names' ('h', 'layers')."""
        self.left = dict(tensors)
        layers = {int(k.split(".")[1]) for k in self.left if re.match(rf"{layer_prefix}\.\d+\.", k)}
        if len(layers) != n_layer:
            raise UserError(f"the weights hold {len(layers)} layers but model.n_layer={n_layer}; "
                            f"set model.n_layer={len(layers)}")

    def get(self, name: str) -> np.ndarray | None:
        """The tensor if present, without taking it."""
        return self.left.get(name)

    def put(self, name: str, x: np.ndarray) -> None:
        """Replace a tensor before it is taken (a table cut to the model's positions)."""
        self.left[name] = x

    def take(self, name: str, shape: tuple[int, ...], hint: str = "") -> np.ndarray:
        """The tensor as fp32, which must exist with this shape; `hint` ends the shape error."""
        if name not in self.left:
            raise UserError(f"tensor {name} is missing from the weights")
        x = self.left.pop(name)
        if tuple(x.shape) != shape:
            raise UserError(f"tensor {name} has shape {tuple(x.shape)} but the model config needs {shape}{hint}")
        return np.asarray(x, np.float32)

    def take_embedding(self, name: str, vocab_size: int, n_embd: int) -> np.ndarray:
        """The [V, D] token embedding; a wrong shape names the vocab_size and n_embd it implies."""
        x = self.left.get(name)
        hint = "" if x is None or x.ndim != 2 else f" (set model.vocab_size={x.shape[0]} model.n_embd={x.shape[1]})"
        return self.take(name, (vocab_size, n_embd), hint)

    def finish(self) -> None:
        """Every tensor must have been taken."""
        t = self.left
        if t:
            raise UserError(f"unexpected tensors in the weights: {', '.join(sorted(t)[:5])}"
                            + (f" and {len(t) - 5} more" if len(t) > 5 else ""))
