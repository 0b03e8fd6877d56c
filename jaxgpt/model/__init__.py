"""The decoder as maths: GPT-2 and the modern options, one room per concern.

    gpt.py        the model: embeddings, the stacked blocks, the head; parameter layout; param_count
    blocks.py     pre-norm residual blocks x + attn(norm(x)), x + mlp(norm(x)); the MoE block, MoE groups
    attention.py  the attention layer and its KV cache
    layers.py     parameters with logical axes, the Norm layer, the dense MLP
    ops.py        the ops every layer calls (linear, norm, activation, residual, attention, embedding,
                  loss) in their reference form; a run hands in a faster lowering (jaxgpt/lowering/)
    positions.py  rotary position embeddings (model.position=rope)
    documents.py  document masking (model.document_mask): documents from <|endoftext|>, masks, window stats
    moe.py        Mixture of Experts: routing, capacity, dispatch/combine, ep all-to-alls
    dropless.py   dropless dispatch: tokens sorted by expert, ragged_dot experts
    balance.py    moe_balance=bias: the routing bias among the parameters
    remat.py      recompute policies, and model.remat=auto's search for the one that fits
"""

from jaxgpt.model.attention import KV, Attention, KVCache
from jaxgpt.model.blocks import Block, MoE, MoEGroup
from jaxgpt.model.gpt import GPT, head_logits, param_count
from jaxgpt.model.layers import MLP, STD, Norm
from jaxgpt.model.ops import Ops, softcap
from jaxgpt.model.remat import REMAT_POLICIES

__all__ = ["GPT", "KV", "KVCache", "REMAT_POLICIES", "STD", "Attention", "Block", "MLP", "MoE", "MoEGroup", "Norm",
           "Ops", "head_logits", "param_count", "softcap"]
