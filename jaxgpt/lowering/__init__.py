"""The lowering layer: how a run computes the model's ops (jaxgpt/model/ops.py), chosen once.

    ops.py          Lowering (the ops with the run's choices), choose (builds it from the config and
                    the mesh), TRICKS, Operand (what travels beside an activation between two ops)
    linear.py       linears: weight copies read in the loop, epilogue biases, q/k/v GEMMs, routed biases
    norm.py         LayerNorm / RMSNorm with a hand-written backward
    activations.py  gelu / relu2 / swiglu with backward passes that keep only the GEMM outputs
    fp8.py          fp8 GEMMs: e4m3 forward, e5m2 gradients, current power-of-two scaling
    loss.py         the fused, chunked head + cross-entropy
    attention.py    the attention kernels (XLA, cuDNN, tokamax) and the choice of one
    flash.py        model.attention=mosaic: tokamax's Mosaic GPU flash attention

The train step's copies of the weights, made once per step for these ops to read, are
jaxgpt/copies.py's. docs/ops.md is the registry of the tricks: what each removes, where it applies,
its predicted and measured gain, and the test that guards it.
"""

from jaxgpt.config import TRICKS
from jaxgpt.lowering.ops import Lowering, Operand, choose, compute_dtype

__all__ = ["TRICKS", "Lowering", "Operand", "choose", "compute_dtype"]
