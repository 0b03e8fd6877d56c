"""Evaluation beyond val loss: multiple-choice tasks (HellaSwag and a generic format) scored by
log-likelihood, during training (`eval.tasks`) and on a checkpoint (`python -m jaxgpt.evaluate`).

    cli.py    python -m jaxgpt.evaluate RUN_DIR --task [NAME=]PATH ...: task accuracy of a checkpoint
    tasks.py  task files -> checked, tokenized (example, choice) sequences, as lm-evaluation-harness builds them
    score.py  the jitted, sharded, length-bucketed scorer; acc and acc_norm

Bits per byte (val_bpb) is part of the val step (jaxgpt/step.py, `val_sums`).
"""
