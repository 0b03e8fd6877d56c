"""Pipeline parallelism: the blocks split into pp stages, micro-batches flowing through them.

Letters: S stages (the pp axis), R repeats (pipeline.repeats), C layers per chunk (L = R*S*C),
M micro-batches per round (pipeline.microbatches), b sequences per micro-batch, T time, D width.

Where the layers live. The stacked blocks' `layers` axis maps to `pp` in the one sharding table
(mesh.RULES), so at rest device s holds layers [s*L/S, (s+1)*L/S) and their AdamW moments, and a
checkpoint's arrays are the same [L, ...] with or without pipelining. Embeddings, the final
LayerNorm and the tied head are replicated over pp: every stage embeds its data shard's rows (a
cheap gather; only stage 0's result is read), and each stage computes the head and loss of M/S of
the micro-batches.

The schedule. `run` is called inside the train step's `shard_map`, which is manual over pp (and
dp), so each device runs one stage on its own layers; fsdp, ep and tp stay automatic inside. A
`lax.scan` over R*M + S - 1 iterations moves the micro-batches: in iteration i stage s works on
pair k = i - s, that is micro-batch m = k mod M on its pass r = k div M, then every stage hands its
output to the next over a ring of collective-permutes (`ppermute`, s -> s+1 mod S). GPipe (R=1),
S=3, M=3, forward (jax.grad runs the same diagram backwards: the ppermute's transpose is the
reverse shift):

    iteration   0    1    2    3    4
    stage 0     m0   m1   m2   .    .       .  bubble: the stage computes on zeros,
    stage 1     .    m0   m1   m2   .          and its output is dropped
    stage 2     .    .    m0   m1   m2
    bubble = (S-1) / (M+S-1) of each stage's iterations = 2/5

The circular schedule (R > 1) cuts the model into R*S chunks of C layers; chunk (r, s), layers
[(r*S + s)*C, (r*S + s + 1)*C), lives on stage s, so each device holds R non-adjacent chunks and
every micro-batch goes round the ring R times. Stage 0 takes pass r of micro-batch m at iteration
r*M + m; since M >= S the previous pass has come back round by then (stage S-1's output reaches
stage 0 over the ring's wrap-around link and waits in a per-micro-batch buffer). The bubble is the
same S-1 iterations, but an iteration is now C = L/(R*S) layers instead of L/S:
(S-1) / (R*M + S - 1). R=2, S=2, M=2 (chunks c0..c3; mX.r is micro-batch X's pass r):

    iteration   0     1     2     3     4
    stage 0     m0.0  m1.0  m0.1  m1.1  .        (chunks 0 then 2)
    stage 1     .     m0.0  m1.0  m0.1  m1.1     (chunks 1 then 3)
    bubble = 1/5 of 5 half-size iterations, where GPipe has 1/3 of 3 full ones

Because the at-rest layout keeps consecutive layers together, R > 1 reorders the stacked axis
into stage-major order (`to_stage_major`) at the start of each step, an all-to-all over pp of the
block weights, and its gradient back (`from_stage_major`): the price of checkpoints that do not
depend on the schedule. R = 1 needs no reordering.

The ring's wrap-around link also brings each micro-batch's final output back to stage 0, into
the same buffer, so after the loop stage 0 holds all M outputs; one reduce-scatter over pp
(`psum_scatter` of the buffer, zero on the other stages) hands each stage M/S of them for the
head. That is why M must be a multiple of S.

What a chunk reports besides its output (an MoE chunk's balancing losses and expert load) is
summed over the stage's real iterations (`totals`), never over bubbles; the caller's psum over pp
adds the stages (jaxgpt/step.py, pipeline_features).

Bubbles are harmless by construction: a stage's input in a bubble slot is replaced by zeros
(`where(valid, x, 0)`) before it computes, and bubble outputs are never stored. Masking the input,
not the output, matters: garbage (even NaN) in an unused slot would otherwise meet a zero
cotangent as NaN * 0 = NaN in the weight gradients (tests/test_pipeline.py injects NaN there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def to_stage_major(blocks: Any, stages: int, repeats: int) -> Any:
    """Stacked block arrays [L, ...] in model order -> [L, ...] whose s-th contiguous share (what
    device s holds under the pp sharding) is chunks (0, s), (1, s), ..., (R-1, s)."""
    return _swap_chunk_axes(blocks, repeats, stages)


def from_stage_major(blocks: Any, stages: int, repeats: int) -> Any:
    """The inverse of `to_stage_major` (the gradients back to model order)."""
    return _swap_chunk_axes(blocks, stages, repeats)


def _swap_chunk_axes(blocks: Any, outer: int, inner: int) -> Any:
    """Each leaf's [outer * inner * C, ...] viewed as [outer, inner, C, ...], its first two axes
    swapped: chunk (o, i) moves to position (i, o). A no-op when there is one chunk per stage."""
    if 1 in (outer, inner):
        return blocks

    def swap(x):
        C = x.shape[0] // (outer * inner)
        return x.reshape(outer, inner, C, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)

    return jax.tree.map(swap, blocks)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes x varies over (its type inside a shard_map)."""
    aval = jax.typeof(x)
    return aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else aval.vma  # JAX 0.10 / older


def vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """x typed as varying over the manual `axes` it does not vary over yet (a no-op otherwise)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def run(run_chunk: Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]], stage_blocks: Any,
        x_MbTD: jax.Array, stages: int, repeats: int, bubble_fill: float = 0.0, remat_policy: Callable | None = None,
        totals: Any = ()) -> tuple[jax.Array, Any]:
    """The S-stage schedule of the module docstring, inside a shard_map manual over 'pp'.

    run_chunk(chunk, x [b, T, D], m, r) -> (x, adds) applies C layers (`chunk`: their stacked
    parameters) to micro-batch m on its pass r (int32 indices, for what the caller keeps per
    micro-batch: document masking's documents; per pass: where an MoE chunk's statistics go);
    `adds` is a pytree like `totals` (zeros: what the stage sums over its real, non-bubble work;
    an MoE model's losses and load), () for none.
    stage_blocks: this stage's R chunks, leaves [R*C, ...] (stage-major order); x_MbTD: the
    embedded micro-batches (read on stage 0). Returns ([M, b, T, D], the blocks' outputs, valid on
    stage 0 only; this stage's totals). `bubble_fill` is what the stages' input slots hold before
    anything arrives (tests set NaN to prove it never reaches a result); `remat_policy`: the
    model's (model.remat)."""
    S, R, M = stages, repeats, x_MbTD.shape[0]
    s = jax.lax.axis_index("pp")
    ring = [(i, (i + 1) % S) for i in range(S)]
    chunks = jax.tree.map(lambda p: p.reshape(R, p.shape[0] // R, *p.shape[1:]), stage_blocks)

    def pair(k):
        """(valid, pass r, micro-batch m) of schedule slot k = r*M + m."""
        valid = (k >= 0) & (k < R * M)
        k = jnp.clip(k, 0, R * M - 1)
        return valid, k // M, k % M

    not_chunk = jax.checkpoint_policies.save_anything_except_these_names("chunk")
    policy = not_chunk if remat_policy is None else lambda *a, **k: not_chunk(*a, **k) and remat_policy(*a, **k)

    @functools.partial(jax.checkpoint, policy=policy)
    def run_pass(chunks, r, x_bTD, m):
        """Chunk r of this stage on x. Its weights, sliced out of the loop-invariant stack, are
        sliced again in the backward pass rather than kept: saved, every iteration would keep a
        copy (gpt2-1.3b, pp=4, R=2 on H100: 16 GiB more). Everything else is kept as the model's
        remat policy says (an outer checkpoint decides for the blocks' inner one)."""
        chunk = jax.tree.map(lambda p: checkpoint_name(p[r], "chunk"), chunks)
        return run_chunk(chunk, x_bTD, m, r)

    def iteration(carry, i):
        buffer_MbTD, received_bTD, totals = carry
        valid, r, m = pair(i - s)
        x_bTD = jnp.where(s == 0, buffer_MbTD[m], received_bTD)
        x_bTD = jnp.where(valid, x_bTD, jnp.zeros_like(x_bTD))  # the input, not the output: see above
        y_bTD, adds = run_pass(chunks, r, x_bTD, m) if R > 1 else run_chunk(stage_blocks, x_bTD, m, r)
        totals = jax.tree.map(lambda t, a: t + jnp.where(valid, a, jnp.zeros_like(a)), totals, adds)
        received_bTD = jax.lax.ppermute(y_bTD, "pp", ring)
        # Stage 0 now holds stage S-1's output of slot i - (S-1): the next pass's input, or a final output.
        back, _, m_back = pair(i - (S - 1))
        keep = back & (s == 0)
        buffer_MbTD = buffer_MbTD.at[m_back].set(jnp.where(keep, received_bTD, buffer_MbTD[m_back]))
        return (buffer_MbTD, received_bTD, totals), None

    axes = tuple(varying_axes(x_MbTD) | {"pp"})
    buffer_MbTD = vary(x_MbTD, axes)
    received_bTD = vary(jnp.full(x_MbTD.shape[1:], bubble_fill, x_MbTD.dtype), axes)
    totals = jax.tree.map(lambda t: vary(t, axes), totals)
    (buffer_MbTD, _, totals), _ = jax.lax.scan(iteration, (buffer_MbTD, received_bTD, totals),
                                               jnp.arange(R * M + S - 1))
    return buffer_MbTD, totals


def scatter_outputs(y_MbTD: jax.Array) -> jax.Array:
    """Stage 0's M outputs -> each stage's M/S of them, [M/S, b, T, D] (micro-batches s*M/S.. on
    stage s): one reduce-scatter over pp of the buffer, zeros everywhere but stage 0."""
    first = jax.lax.axis_index("pp") == 0
    y_MbTD = jnp.where(first, y_MbTD, jnp.zeros_like(y_MbTD))
    scatter = functools.partial(jax.lax.psum_scatter, axis_name="pp", scatter_dimension=0, tiled=True)
    if jnp.dtype(y_MbTD.dtype).itemsize >= 4:
        return scatter(y_MbTD)
    # XLA:CPU aborts the process on a 16-bit reduce-scatter or all-reduce inside a shard_map that is
    # manual over only some of the mesh axes, as the steps' are (pp, dp): JAX annotates the reducer's
    # add with a sharding, and the CPU pass that widens 16-bit reductions to fp32 (AllReducePromotion)
    # then finds a copy, not the add, at the reducer's root ("Invalid binary instruction opcode copy";
    # JAX 0.10.2 to 0.12, issue 24). So on CPU the sum is taken in fp32, exact here (one non-zero
    # term per element); other platforms keep the bf16 reduce-scatter (the branch is picked when
    # lowering, so their program is unchanged).
    via_f32 = lambda y: scatter(y.astype(jnp.float32)).astype(y.dtype)  # noqa: E731
    return jax.lax.platform_dependent(y_MbTD, cpu=via_f32, default=scatter)


def my_share(a_M: jax.Array, stages: int) -> jax.Array:
    """This stage's M/S rows of a [M, ...] array, the ones `scatter_outputs` gives it."""
    n = a_M.shape[0] // stages
    return jax.lax.dynamic_slice_in_dim(a_M, jax.lax.axis_index("pp") * n, n, axis=0)


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
    """Idle share of each stage's time in one round: (S-1) / (R*M + S - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def schedule_summary(stages: int, repeats: int, microbatches: int, rounds: int, n_layer: int,
                     rows_per_device: int, seq_len: int, width: int, itemsize: int) -> dict:
    """What `jaxgpt.plan` prints about the schedule: its shape, bubble and the activation bytes each
    stage sends per optimizer step (`rounds` = train.grad_accum pipeline rounds; rows_per_device =
    one micro-batch's sequences on a device). Every iteration sends one [b, T, D] block forward,
    and its gradient comes back in the backward pass; bubble iterations send too."""
    iterations = repeats * microbatches + stages - 1
    block = rows_per_device * seq_len * width * itemsize
    return {"schedule": "GPipe" if repeats == 1 else f"circular (repeats={repeats})", "stages": stages,
            "repeats": repeats, "microbatches": microbatches, "iterations": iterations,
            "layers_per_chunk": n_layer // (stages * repeats),
            "bubble": bubble_fraction(stages, repeats, microbatches),
            "block_bytes": block, "send_bytes_per_step": 2 * rounds * iterations * block}
