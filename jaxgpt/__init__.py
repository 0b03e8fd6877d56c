"""jaxgpt: GPT pretraining in JAX/Flax over data, FSDP and tensor-parallel meshes."""

__version__ = "0.1.0"
