"""The parallel machinery: what each file holds.

    mesh.py         the pp x dp x fsdp x ep x tp mesh and the sharding table RULES (logical axis -> mesh axes)
    manual.py       per_shard: a shard_map manual over every free mesh axis (cuDNN attention)
    pipeline.py     pp: GPipe and circular schedules, a ring of collective-permutes over the stages
    distributed.py  jax.distributed start-up, process-ordered devices, each process's batch rows
"""
