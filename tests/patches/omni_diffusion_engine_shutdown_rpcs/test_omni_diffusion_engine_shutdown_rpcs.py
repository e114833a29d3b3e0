"""omni-diffusion-engine-shutdown-rpcs on the REAL DiffusionEngine of every release in and around its range.

Each release runs in a child of its own (``Release.call`` of ``case.stock_then_patched``): the wheel's real
``diffusion_engine.py`` -- its busy loop, RPC queue, ``collective_rpc`` and ``close`` -- with a batch running, a
``collective_rpc("sleep")`` without a timeout queued behind it, then ``close()`` while shutdown stops the workers under
the batch (its executor call raises). Stock first, then the shim activated in the same process; 0.31.0rc1 (upstream's
``break`` to the tail) and 0.29.0rc1 (no early return yet) run the same scenarios. A control scenario (the batch
finishes, no shutdown) shows the RPC answered by the executor, stock and patched alike. Untagged older trees are
audited too: "not affected", decided by code features.
"""
import json

import pytest

from omni_patches import cli
from omni_patches.tools import audit
from patches.omni_diffusion_engine_shutdown_rpcs import case
from support import wheels
from support.wheels import fetch_or_skip

# How long the caller is given once the executor call was interrupted. Stock never answers: by then the busy loop has
# ended and close() has returned, so nothing is left to fail the queued RPC (any bound shows it); patched and
# 0.31.0rc1 answer within milliseconds.
DEADLINE_S = 2.0
FIXED = "0.31.0rc1"


@pytest.fixture(scope="module")
def runs():
    out = {}
    for version in [*case.AFFECTED, FIXED, case.BEFORE]:
        fetch_or_skip("vllm-omni", version)
        out[version] = case.release(version).call(case.stock_then_patched, DEADLINE_S)
    return out


def _outcome(run):
    """What a caller can observe, timing aside."""
    return {k: run[k] for k in ("closed", "outcome", "left_in_queue", "executor_rpcs", "loop_ended",
                                "close_returned")}


@pytest.mark.parametrize("version", case.AFFECTED)
def test_stock_leaves_the_rpc_waiting_and_the_patch_fails_it_as_upstream_does(runs, version):
    res, fixed = runs[version], runs[FIXED]
    stock, patched = res["stock"], res["patched"]
    assert f"vllm-omni-{version}" in stock["file"]
    # Stock: the loop has ended and close() returned, the RPC is still queued, its caller still waiting.
    assert stock["outcome"] == "blocked" and stock["seconds"] is None, stock
    assert stock["loop_ended"] and stock["close_returned"] and stock["left_in_queue"] == 1, stock
    # Patched: the caller gets upstream's error at once, and everything else is as 0.31.0rc1 leaves it.
    assert res["status"]["state"] == "applied", res["status"]
    assert patched["outcome"] == case.SHUTTING_DOWN and patched["seconds"] < 1.0, patched
    assert _outcome(patched) == _outcome(fixed["stock"])
    assert "1 queued RPC(s) failed" in res["status_after"]["reason"]
    # No shutdown: the RPC runs on the executor once the batch is done, stock and patched alike.
    assert _outcome(res["patched_no_shutdown"]) == _outcome(res["stock_no_shutdown"]) \
        == _outcome(fixed["stock_no_shutdown"])
    assert res["stock_no_shutdown"]["outcome"] == ["sleep: ok"]


def test_fixed_release_fails_the_rpc_and_skips(runs):
    res = runs[FIXED]
    assert res["stock"]["outcome"] == case.SHUTTING_DOWN and res["stock"]["left_in_queue"] == 0
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert _outcome(res["patched"]) == _outcome(res["stock"])


def test_release_before_the_early_return_is_outside(runs):
    res = runs[case.BEFORE]
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]
    # 0.29.0rc1's loop goes on after the failed batch and runs the queued RPC on the stopped executor: its caller
    # gets that error, not a hang.
    assert res["stock"]["outcome"] == "RuntimeError: diffusion executor is shut down", res["stock"]
    assert _outcome(res["patched"]) == _outcome(res["stock"])


@pytest.mark.parametrize("version,why", [
    ("0.20.0", "has no RPC queue"),  # collective_rpc went straight to the executor: nothing queued to wait on
    ("0.29.0rc1", "always reaches its RPC-failing tail"),  # the RPC queue without the early return
])
def test_untagged_older_code_is_not_affected(tmp_path, capsys, version, why):
    """``git archive`` of an older tag (vllm-omni reports 0.0.0): the code features say "not affected", not drift."""
    fetch_or_skip("vllm-omni", version)
    tree = wheels.tagless(tmp_path, "vllm-omni", version, "vllm_omni")
    capsys.readouterr()
    cli.main(["audit", "--json", "--source", str(tree), "--cache", str(tmp_path / "cache")])
    got = {p["id"]: p for p in json.loads(capsys.readouterr().out)["patches"]}[case.PATCH_ID]
    assert got["verdict"] == audit.NOT_AFFECTED and "decided by code features" in got["detail"], got
    assert why in got["detail"], got
