"""omni-diffusion-idle-abort-terminal on the REAL DiffusionEngine busy loop and RequestScheduler of every release in
its range.

Each release runs in its own child (``Release.call`` of ``case.run``): the real ``diffusion_engine.py`` and
``diffusion/sched/*.py`` from the PyPI wheel, the real ``DiffusionOutput``, stand-ins for the rest (``case.py``
says which). A request is aborted while it waits behind a running one; when that one ends, the scheduler is idle.
Stock first (the aborted request's stream is read for a deadline), then the shim activated in the same process.
0.32.0rc1 (upstream's fix in ``_busy_loop``) runs the same scenario: the patched releases must give exactly its
outputs and leave exactly its state. 0.28.0rc1-0.29.0rc1 show the same waiting abort, outside the patch's range.
"""
import pytest

from patches.omni_diffusion_idle_abort_terminal import case
from support.wheels import fetch_or_skip

STOCK_WAIT_S = 2.0  # the stock busy loop wakes every 1.0 s while idle and still emits nothing: two wake-ups
AFFECTED = case.AFFECTED
FIXED = ["0.32.0rc1"]
BEFORE = ["0.28.0rc1", "0.28.0", "0.29.0rc1"]  # the same waiting abort, no pending_finished_request_ids
ABORTED = {"aborted": True, "abort_message": "Request victim aborted.", "error": None, "finished": True,
           "output": None}
LEFT_BEHIND = {"stream_kept": True, "scheduler_state": "FINISHED_ABORTED", "has_requests": False}


def _outcome(res):
    """Everything the caller and the engine show, timings aside."""
    return {k: v for k, v in res.items() if k not in ("file", *case.TIMINGS)}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for v in AFFECTED + FIXED + BEFORE:
        fetch_or_skip("vllm-omni", v)
        out[v] = case.release(v).call(case.run, STOCK_WAIT_S)
    return out


@pytest.mark.parametrize("version", AFFECTED)
def test_stock_leaves_the_abort_waiting_and_the_patch_ends_it_as_upstream_does(runs, version):
    res, fixed = runs[version], runs["0.32.0rc1"]["stock"]
    stock, patched = res["stock"], res["patched"]
    assert stock["file"].endswith(case.ENGINE) and stock["loop_error"] is None
    # Stock: nothing on the aborted request's stream within the deadline; its stream and scheduler state stay.
    assert stock["victim_s"] is None and stock["victim_in_time"] == [], stock
    assert stock["after"] == {**LEFT_BEHIND, "pending_finished": ["victim"]}
    # ... until another request comes: its wave carries the abort.
    assert stock["victim"] == [ABORTED] and stock["victim_late_s"] is not None

    assert res["status"]["state"] == "applied", res["status"]
    assert patched["victim_s"] is not None and patched["victim_s"] < 1.0, patched
    assert patched["victim_in_time"] == [ABORTED]
    assert _outcome(patched) == _outcome(fixed)  # outputs, state left, waves (what the workers saw), loop alive
    assert "finished requests surfaced while the scheduler was idle: 1" in res["status_after"]["reason"]


@pytest.mark.parametrize("version", FIXED)
def test_fixed_release_skips_and_ends_the_abort_itself(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert res["stock"]["victim_in_time"] == [ABORTED] and res["stock"]["after"]["stream_kept"] is False
    assert _outcome(res["patched"]) == _outcome(res["stock"])


@pytest.mark.parametrize("version", BEFORE)
def test_older_releases_leave_the_abort_waiting_too_outside_the_range(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]
    stock = res["stock"]
    assert stock["victim_s"] is None and stock["victim_in_time"] == []
    assert {k: stock["after"][k] for k in LEFT_BEHIND} == LEFT_BEHIND
    assert stock["victim"] == [ABORTED]  # surfaced by the next request's wave
    assert _outcome(res["patched"]) == _outcome(stock)
