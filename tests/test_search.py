"""`python -m jaxgpt.plan --search`: layouts enumerated within the model's shapes and the nodes, a
ranking of XLA:GPU compiles for 8 compile-only H100s that is the same every time (and from the
cache), and the top layouts each training a step on the 8 fake CPU devices."""

from __future__ import annotations

import argparse
import math
import os
import signal

import pytest
from helpers import TINY, tiny_config, train_losses

from jaxgpt import plan
from jaxgpt.cli import EXIT_INTERRUPTED, run_main
from jaxgpt.config import validate
from jaxgpt.gpu import search
from jaxgpt.gpu.target import INSTALL, compile_only_devices, plugin_missing_reason
from jaxgpt.train import train

needs_plugin = pytest.mark.skipif(plugin_missing_reason() is not None,
                                  reason=f"needs the CUDA plugin to compile for H100: {INSTALL}")
TOP = 2  # compiled and ranked (the command compiles 12): a ranking, each one an H100 compile of ~10 CPU s


def test_layouts_are_every_product_with_tp_and_ep_inside_a_node():
    dense = search.layouts(8, 8, moe=False)
    assert all(math.prod(s.values()) == 8 and s["ep"] == 1 for s in dense)
    assert len(dense) == len({tuple(s.values()) for s in dense}) == 20  # 8 = 2^3 over pp, dp, fsdp, tp: C(6,3)
    two_nodes = search.layouts(16, 8, moe=True)
    assert all(s["tp"] * s["ep"] <= 8 for s in two_nodes) and {"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "ep": 1, "tp": 8} in two_nodes
    assert len(search.layouts(16, 8, moe=True, across_nodes=True)) > len(two_nodes)
    # tp inside a node, dp (the slower axis) across the two
    assert search.inside_node({"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "ep": 1, "tp": 8}, "tp", 8)
    assert not search.inside_node({"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "ep": 1, "tp": 8}, "dp", 8)


def test_candidates_are_the_valid_ones_in_a_fixed_order():
    cfg = tiny_config("model.n_head=2")  # tp=4 and 8 cannot split 2 heads
    first, again = search.candidates(cfg, 8, 8), search.candidates(cfg, 8, 8)
    assert [c.key() for c in first] == [c.key() for c in again] and first
    assert all(c.sizes["tp"] <= 2 for c in first)
    for c in first:
        assert validate(c.config(cfg), 8) == c.sizes


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """The search run twice over one cache: (first result, second result, the cache dir)."""
    devices = compile_only_devices("h100", 8)
    cache = tmp_path_factory.mktemp("search-cache")
    cfg = tiny_config()

    def run():
        return search.search(cfg, 8, "h100", lambda c: plan.plan(c, devices, None, "h100"), compile_top=TOP,
                             cache=cache)
    return run(), run(), cache, devices


@needs_plugin
def test_the_ranking_is_deterministic_and_cached(searched):
    first, second, cache, _ = searched
    assert first["counts"]["compiled"] == TOP and len(first["ranked"]) == TOP  # the tiny model fits everywhere
    assert len(list(cache.glob("*.json"))) == TOP
    key = lambda r: [(c.key(), row["step_seconds"]) for c, row in r["ranked"]]  # noqa: E731
    assert key(first) == key(second)
    seconds = [row["step_seconds"] for _, row in first["ranked"]]
    assert seconds == sorted(seconds) and all(s > 0 for s in seconds)
    text = search.format_search(first, "tiny", "h100", 8, None, TINY)
    best = first["ranked"][0][0]
    assert f"fastest: python -m jaxgpt.train --mesh {best.mesh} " in text and text.endswith(
        f"model.remat={best.remat} train.grad_accum={best.grad_accum}")


@needs_plugin
def test_ctrl_c_keeps_the_ranking_so_far(searched):
    """A real SIGINT during the compile after the cached ones (the fixture's TOP): those are ranked."""
    first, _, cache, devices = searched

    def interrupted_plan(cfg):
        os.kill(os.getpid(), signal.SIGINT)
        return plan.plan(cfg, devices, None, "h100")
    result = search.search(tiny_config(), 8, "h100", interrupted_plan, compile_top=TOP + 1, cache=cache)
    assert result["interrupted"] and [c.key() for c, _ in result["ranked"]] == [c.key() for c, _ in first["ranked"]]
    assert "interrupted: the ranking of what was compiled" in search.format_search(result, "tiny", "h100", 8, None, [])


@needs_plugin
def test_ctrl_c_ends_with_a_line_for_the_search(searched, tmp_path, monkeypatch, capfd):
    """Issue 59 item 2: after the ranking, the last line says the compile in progress was dropped and
    that the same command goes on from the cached compiles, not training's 'resumes from its newest
    checkpoint'; exit 130. A real SIGINT during the compile after the TOP cached ones, through the command's run_main."""
    first, _, cache, devices = searched
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path))
    (tmp_path / "plan-search").symlink_to(cache)  # the fixture's TOP cached compiles

    def interrupted_plan(cfg):
        os.kill(os.getpid(), signal.SIGINT)
        return plan.plan(cfg, devices, None, "h100")
    args = argparse.Namespace(target="h100", gpus_per_node=None, compile_top=TOP + 1, config=None, overrides=TINY,
                              json=None)
    assert run_main(lambda argv: search.run(args, 8, interrupted_plan, tiny_config(), None)) == EXIT_INTERRUPTED
    out, err = capfd.readouterr()
    assert "interrupted: the ranking of what was compiled" in out and out.count("\n -  ") == 0
    last = err.strip().splitlines()[-1]
    assert last == (f"interrupted; the compile in progress was dropped: run the same command to go on from the "
                    f"{TOP} layout(s) compiled so far (cached in {tmp_path / 'plan-search'})"), err
    assert "training" not in last and "checkpoint" not in last


def test_the_memory_lines_say_what_a_layout_needs_of_what_a_gpu_has():
    """Issue 59 item 4: the header and a dropped layout's row give the need and the capacity together."""
    sizes = {"pp": 1, "dp": 8, "fsdp": 1, "cp": 1, "ep": 1, "tp": 1}
    row = {"step_seconds": 1.0, "tokens_per_sec": 1e5, "mfu": 0.4, "collective_seconds": 0.01,
           "collective_exposed_seconds": 0.0}
    result = {"ranked": [(search.Candidate(sizes, "dots", 1), {**row, "peak_bytes": 30 * search.GIB, "fits": True})],
              "dropped": [(search.Candidate(sizes, "none", 1), {**row, "peak_bytes": 85 * search.GIB, "fits": False})],
              "interrupted": False, "memory_bytes": 80 * search.GIB,
              "counts": {"valid": 2, "fit_estimate": 2, "compiled": 2}}
    text = search.format_search(result, "tiny", "h100", 8, None, [])
    assert "2 compiled, 1 need at most the 80.0 GiB a GPU has" in text.splitlines()[0]
    assert "does not fit: needs 85.0 of 80.0 GiB" in text


@needs_plugin
@pytest.mark.parametrize("rank", range(TOP))
def test_the_top_layouts_train(searched, rank, tmp_path, shakespeare_dir):
    c, _ = searched[0]["ranked"][rank]
    train(tiny_config(*c.overrides(), "train.steps=1", mesh=c.mesh), tmp_path)
    assert len(train_losses(tmp_path)) == 1


@pytest.mark.parametrize("args, says", [
    (["--search", "--gpus", "8"], "--gpus needs --target"),
    (["--search"], "--search ranks layouts by the GPU step-time model: give --target"),
    (["--search", "--target", "h100", "--gpus", "8", "--mesh", "dp=8"], "--search chooses the mesh itself"),
    (["--search", "--target", "h100", "--gpus", "8", "--compile-top", "0"], "--compile-top must be positive"),
    (["--target", "h100", "--gpus", "8", "--compile-top", "4"], "--compile-top is an option of --search"),
    (["--gpus-per-node", "4"], "--gpus-per-node needs --target"),
])
def test_search_arguments_are_checked_in_one_line(capsys, args, says):
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
