"""The decoder: GPT-2 and the modern options, one room per concern.

    gpt.py        the model: embeddings, the scanned blocks, the head; parameter layout; param_count
    blocks.py     pre-norm residual blocks, the MoE block, MoE groups
    attention.py  the attention layer, its KV cache, and the kernel choice (xla / cudnn / mosaic)
    flash.py      model.attention=mosaic: tokamax's Pallas Mosaic GPU flash attention
    positions.py  rotary position embeddings (model.position=rope)
    documents.py  document masking (model.document_mask): documents from <|endoftext|>, masks, window stats
    layers.py     parameters with logical axes, compute dtype, the Norm layer, the dense MLP
    norm.py       LayerNorm/RMSNorm with a hand-written backward (bf16 in and out, fp32 statistics)
    activations.py  the dense MLP's gelu/relu2/swiglu, backward passes keeping only the GEMM outputs
    moe.py        Mixture of Experts: routing, capacity, dispatch/combine, ep all-to-alls
    fp8.py        direct fp8 GEMMs with current scaling; the named linears every GEMM goes through
    loss.py       the fused, chunked output head + cross-entropy
    remat.py      recompute policies, and model.remat=auto's search for the one that fits

The names below were `jaxgpt/model.py`'s and stay importable from `jaxgpt.model`.
"""

from jaxgpt.model.attention import KV, Attention, KVCache
from jaxgpt.model.blocks import Block, MoE, MoEGroup
from jaxgpt.model.fp8 import PrequantizedFp32Grad
from jaxgpt.model.gpt import GPT, head_logits, head_table, param_count, softcap
from jaxgpt.model.layers import (MLP, STD, Norm, PrecastFp32Grad, compute_dtype, copies_once_per_step,
                                 from_gemm_pieces, gemm_pieces, precast_weights, prequantize_weights,
                                 with_prequantized)
from jaxgpt.model.remat import REMAT_POLICIES

__all__ = ["GPT", "KV", "KVCache", "REMAT_POLICIES", "STD", "Attention", "Block", "MLP", "MoE", "MoEGroup", "Norm",
           "compute_dtype", "head_logits", "head_table", "param_count", "softcap"]
