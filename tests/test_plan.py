"""The planner and the benchmark: per-device memory follows the layout, collective bytes are read
exactly from HLO (loops multiplied by their trip counts), and both commands run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest
from helpers import GPT2_VOCAB, REPO, TINY, main_in_process, run_cli, tiny_config

from jaxgpt.cli import EXIT_USER_ERROR
from jaxgpt.hlo import collective_bytes, collective_ops, gemm_counts, wire_bytes
from jaxgpt.model import param_count
from jaxgpt.plan import format_plan, plan


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    """The tiny model with GPT-2's vocabulary, whose table is most of its parameters (as in a real model's)."""
    return {layout: plan(tiny_config(*GPT2_VOCAB, mesh=layout), jax.devices()) for layout in ("dp=8", "fsdp=8")}


def test_fsdp_holds_an_eighth_of_what_dp_holds(plans):
    """fsdp=8 splits every parameter with a D dimension 8 ways; only the QKV and MLP-in biases (no D
    axis, 7D floats per layer) stay whole, which is far below 1% of the tiny model."""
    dp, fsdp = plans["dp=8"], plans["fsdp=8"]
    assert dp["parameters"] == fsdp["parameters"] == param_count(tiny_config(*GPT2_VOCAB).model)
    assert dp["state_bytes"]["parameters"] == 4 * dp["parameters"]  # fp32, replicated
    for part in ("parameters", "gradients", "optimizer_state"):
        assert fsdp["state_bytes"][part] == pytest.approx(dp["state_bytes"][part] / 8, rel=0.01), part
    assert fsdp["memory"]["arguments"] < dp["memory"]["arguments"] / 4


def test_collectives_follow_the_layout(plans):
    """dp: gradients all-reduced (at least every parameter once), nothing gathered. fsdp: every
    sharded weight gathered at least once before use."""
    dp, fsdp = plans["dp=8"]["collectives"], plans["fsdp=8"]["collectives"]
    full = plans["dp=8"]["state_bytes"]["parameters"]
    assert dp["bytes"]["all-gather"] == 0 and dp["bytes"]["all-reduce"] >= full
    assert fsdp["bytes"]["all-gather"] >= 0.99 * full
    assert fsdp["bytes"]["all-reduce"] + fsdp["bytes"]["reduce-scatter"] > 0
    assert not dp["unknown_trip_counts"] and not fsdp["unknown_trip_counts"]


HLO = """HloModule snippet, entry_computation_layout={(f32[8,16]{1,0}, bf16[4]{0})->f32[8,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ag = f32[8,16]{1,0} all-gather(%x), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ag)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,16], y: bf16[4]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %y = bf16[4]{0} parameter(1)
  %ar = (f32[8,16]{1,0}, bf16[4]{0}) all-reduce(%x, %y), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %rs = f32[2]{0} reduce-scatter(%x), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %cp-start = (f32[3]{0}, f32[3]{0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[3]{0} collective-permute-done(%cp-start)
  %g-start = (pred[10]{0}, pred[80]{0}) all-gather-start(%y), replica_groups=mesh['a'=8] {'a'}, dimensions={0}
  %g-done = pred[80]{0} all-gather-done(%g-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)
  %w = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""


def test_collective_bytes_of_a_hand_written_snippet():
    """Tuple results summed (512 + 8), a loop body counted per iteration (512 x 5), async pairs
    counted once at -done, element sizes from the dtype (pred: 1 byte)."""
    assert collective_bytes(HLO) == {"all-reduce": 8 * 16 * 4 + 4 * 2, "all-gather": 8 * 16 * 4 * 5 + 80,
                                     "reduce-scatter": 2 * 4, "all-to-all": 0, "collective-permute": 3 * 4}
    # ring traffic: all-reduce 2(n-1)/n over groups of 4, all-gather (n-1)/n over 8, reduce-scatter n-1
    assert wire_bytes(HLO, n_devices=8) == {"all-reduce": 780, "all-gather": 2240 + 70, "reduce-scatter": 24,
                                           "all-to-all": 0, "collective-permute": 12}


def test_gemm_counts_tell_fp8_gemms_from_others():
    """XLA:GPU's compiled HLO, as it writes a cuBLASLt fp8 GEMM, a bf16 cuBLAS GEMM and a Triton
    GEMM fusion with fp8 operands (benchmark.py reports these; XLA:CPU writes none)."""
    gpu = "\n".join([
        '  %m.3 = (bf16[4096,2304]{1,0}, s8[4]{0}) custom-call(f8e4m3fn[4096,768]{1,0} %p.1, '
        'f8e4m3fn[2304,768]{1,0} %p.2, f32[] %s.1, f32[] %s.2), custom_call_target="__cublas$lt$matmul$f8"',
        '  %g.1 = (f32[768,768]{1,0}, s8[4]{0}) custom-call(bf16[4096,768]{1,0} %a, bf16[4096,768]{1,0} %b), '
        'custom_call_target="__cublas$gemm"',
        '  %gemm_fusion_dot.2 = bf16[8192,768]{1,0} fusion(f8e5m2[8192,3072]{1,0} %g, f8e4m3fn[768,3072]{1,0} %w), '
        'kind=kCustom, calls=%c, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        '  %add.1 = f32[] add(f32[] %x, f32[] %y)'])
    assert gemm_counts(gpu) == {"fp8": 2, "other": 1}
    assert gemm_counts(HLO) == {"fp8": 0, "other": 0}


def test_trip_count_from_the_condition_or_counted_once_with_a_warning():
    no_config = HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
    assert collective_bytes(no_config)["all-gather"] == 512 * 3 + 80  # the condition's constant
    unreadable = no_config.replace("%n = s32[] constant(3)", "%n = s32[] constant(3)\n  %m = s32[] constant(4)")
    assert collective_ops(unreadable)[1] == ["body"]
    with pytest.warns(UserWarning, match="lower bound"):
        assert collective_bytes(unreadable)["all-gather"] == 512 + 80


def test_plan_command_prints_the_plan():
    proc = main_in_process("--mesh", "dp=8", *TINY, module="jaxgpt.plan")
    assert proc.returncode == 0, proc.stderr
    assert f"parameters: {param_count(tiny_config().model):,}" in proc.stdout
    for link in ("PCIe 4 x16", "PCIe 5 x16", "NVLink 4", "InfiniBand 400 Gb/s"):
        assert f"| {link}" in proc.stdout
    assert "all-reduce" in proc.stdout and "CPU-compiled estimates" in proc.stdout


def test_plan_command_fakes_devices_and_warns_when_it_does_not_fit():
    proc = run_cli("--fake-devices", "2", "--mesh", "fsdp=2", "--device-memory-gib", "0.001", *TINY,
                   module="jaxgpt.plan")
    assert proc.returncode == 0, proc.stderr
    assert "on 2 cpu devices" in proc.stdout
    assert "this would not fit" in proc.stdout and "this would not fit" in proc.stderr
    # issue 59 item 4: the need and the capacity in one line, not the capacity alone beside a verdict
    total = next(line for line in proc.stdout.splitlines() if line.strip().startswith("total")).split()[-1]
    assert f"memory per device: needs {total} of 1.0 MiB: this would not fit" in proc.stdout.splitlines(), proc.stdout


def test_the_memory_line_says_what_the_step_needs_of_what_a_device_has(plans):
    """Issue 59 item 4: `needs X of Y MiB: fits`, where Y (the device's) used to stand alone."""
    p = dict(plans["dp=8"], device_memory_bytes=80 * 2**30)
    p["fits"] = p["memory"]["peak"] <= p["device_memory_bytes"]
    lines = format_plan(p, "tiny", tiny_config(mesh="dp=8")).splitlines()
    assert f"memory per device: needs {p['memory']['peak'] / 2**20:,.1f} of 81,920.0 MiB: fits" in lines
    assert not any(line.startswith("device memory") for line in lines)


def test_plan_command_bad_mesh_is_one_line():
    proc = main_in_process("--mesh", "dp=3", *TINY, module="jaxgpt.plan")
    assert proc.returncode == EXIT_USER_ERROR
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        "error: mesh pp=1,dp=3,fsdp=1,cp=1,ep=1,tp=1 has 3 devices but 8 are available"]
    for n, says in (("0", "must be positive"), ("100000", "at most 2,048")):  # 100,000 used to hang silently
        proc = run_cli("--fake-devices", n, *TINY, module="jaxgpt.plan", timeout=60)
        assert proc.returncode == EXIT_USER_ERROR and proc.stderr.startswith("error: --fake-devices") and \
            says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_benchmark_smoke(tmp_path, shakespeare_dir):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/benchmark.py", "--mesh", "dp=8", *TINY, "--steps", "2",
                           "--warmup", "1", "--input-batches", "5", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    for key in ("compile_s", "step_ms", "tokens_per_sec", "mfu", "memory", "collective_bytes",
                "input_tokens_per_sec", "input_ratio", "devices", "mesh", "commit", "attention", "gemm_calls"):
        assert key in r, key
    assert r["devices"] == 8 and r["mfu"] is None  # no peak FLOP/s for CPUs
    assert set(r["step_ms"]) >= {"median", "p10", "p90"}
    assert r["collective_bytes"]["all-reduce"] > 0 and r["memory"]["peak"] > 0
    assert proc.stdout.strip().splitlines()[-1].startswith("| shakespeare | dp=8 | 8 |")


class _GPU:
    """A device that says what it holds, as a GPU's allocator does (memory_stats()['bytes_limit'])."""
    platform = "gpu"

    def __init__(self, bytes_limit: int):
        self.bytes_limit = bytes_limit

    def memory_stats(self) -> dict:
        return {"bytes_limit": self.bytes_limit}


def test_a_step_over_an_accelerators_memory_is_refused_before_it_runs():
    """check_memory against a device's allocator limit (what train does before its first step on a
    GPU): the state's shapes first, then XLA's memory analysis of the compiled step; a limit above
    the step's peak passes."""
    from jaxgpt.errors import UserError
    from jaxgpt.parallel.mesh import make_mesh
    from jaxgpt.plan import abstract_inputs, activation_floor, check_memory, memory_analysis
    from jaxgpt.step import make_setup, make_train_step

    cfg = tiny_config(mesh="fsdp=8")
    mesh = make_mesh({"fsdp": 8}, jax.devices())
    with jax.set_mesh(mesh):
        setup = make_setup(cfg, mesh)
        state, batch = abstract_inputs(cfg, mesh, setup)
        step = make_train_step(cfg, mesh, setup)
        peak = memory_analysis(step.lower(state, batch).compile())["peak"]
    with pytest.raises(UserError, match=r"the train state alone .* GiB of memory per GPU device, but 0\.0 GiB"):
        check_memory(step, state, batch, mesh, _GPU(1024))
    with pytest.raises(UserError, match=r"the train step needs .* GiB of memory per GPU device .* more devices"):
        check_memory(step, state, batch, mesh, _GPU(peak - 1))
    check_memory(step, state, batch, mesh, _GPU(peak))
    # the activations' floor, before compiling (XLA:CPU's compiler crashed with SIGFPE on a step of
    # 2**30 tokens a micro-batch): the real step needs more than the floor, so the floor alone passes
    floor = activation_floor(cfg, {"pp": 1, "dp": 1, "fsdp": 8, "cp": 1, "ep": 1, "tp": 1})
    assert 0 < floor < peak
    with pytest.raises(UserError, match=r"needs more than .* each layer's input for one micro-batch"):
        check_memory(step, state, batch, mesh, _GPU(peak), floor=peak)


def test_remat_auto_on_a_cpu_fits_the_hosts_memory(tmp_path, monkeypatch, capsys, shakespeare_dir):
    """On a CPU, model.remat=auto fits the host memory still available shared by the local devices,
    the same figure check_memory holds the step to: with too little for 'none' it takes a policy with
    recompute, and that run trains."""
    from jaxgpt import plan as plan_module
    from jaxgpt.model import remat
    from jaxgpt.train import train

    cfg = tiny_config("model.remat=auto", "train.steps=1", "train.eval_every=0", "checkpoint.every=0",
                      mesh="dp=8")
    peaks = {p: plan(remat.with_remat(cfg, p), jax.devices())["memory"]["peak"] for p in ("none", "full")}
    assert peaks["full"] < peaks["none"], peaks
    host = 8 * (peaks["none"] - 1)  # every policy with recompute that fits is taken before full
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: host)
    assert plan_module.memory_per_device(jax.devices()) == peaks["none"] - 1
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert "the least recompute that fits" in out and "| remat none" not in out, out
