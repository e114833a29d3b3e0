"""omni-stagepool-cancelled-submit on the REAL vllm_omni/engine/stage_pool.py of every vllm-omni release it covers.

Each release runs in a child (``case.scenario`` through ``Release.call``): the real ``StagePool`` of the PyPI wheel
(its other imports permissive stand-ins), one AR replica whose client records what EngineCore saw. A submission is
accepted by the engine and then fails, or is cancelled (and, in two modes, the abort that follows fails or is
cancelled too); a second request in flight at the same time; a diffusion stage's failed add; a plain success. Each
mode runs on stock, on this release's pool with 0.32.0rc1's REAL ``submit_initial`` compiled in
(``case.fixed_pool_class``: upstream's fixed code on the same pool, its abort through this release's own
``abort_requests``), and patched. The whole 0.32.0rc1 release runs the same modes.
"""
import pytest

from patches.omni_stagepool_cancelled_submit import case

REJECTED = ["fail", "cancel", "fail-abort-fails", "cancel-abort-cancelled", "cancel-one-of-two"]
UNTOUCHED = ["ok", "fail-diffusion"]  # no failed AR add: 0.32.0rc1's change does not run, nor does the patch
ABORT_FAILS = ["fail-abort-fails", "cancel-abort-cancelled"]


@pytest.fixture(scope="module")
def fixed():
    """The fixed release, whole: its stock is upstream's behaviour; the patch stays out."""
    return case.release(case.FIXED).call(case.scenario, case.MODES)


def _stock_leaves_it_running(stock):
    for mode in REJECTED:
        run = stock[mode]
        assert "req-1" in run["running"], (mode, run)  # EngineCore runs it to the end, holding its KV cache
        assert not [c for c in run["engine"] if c[0] == "abort"], (mode, run)
        if mode.startswith("cancel"):  # not even rolled back: a CancelledError passes `except Exception`
            assert run["bound"][0] == 0 and "req-1" in run["processor"], (mode, run)
        else:
            assert run["bound"] == [None] and run["processor"] == [], (mode, run)


@pytest.mark.parametrize("version", case.AFFECTED)
def test_stock_leaves_the_accepted_request_running_and_the_patch_aborts_it_as_0_32_does(fixed, version):
    res = case.release(version).call(case.scenario, case.MODES)
    assert res["status"]["state"] == "applied", res["status"]
    _stock_leaves_it_running(res["stock"])
    upstream = fixed["stock"]
    for mode in case.MODES:
        patched = res["patched"][mode]
        assert patched["raised"] == upstream[mode]["raised"], (mode, patched, upstream[mode])
        if mode in UNTOUCHED:
            assert patched == res["stock"][mode] == upstream[mode], (mode, patched, res["stock"][mode])
            continue
        # Upstream's fixed submit_initial on this very pool: every field, the abort and the rollback included.
        assert patched == res["fixed_here"][mode], (mode, patched, res["fixed_here"][mode])
        # The fixed release as a whole: the same, but where its abort failed the output processor's state is what
        # this release's own abort_requests left (before 0.28.0 it drops it only after EngineCore answered).
        same = {k: v for k, v in patched.items() if mode not in ABORT_FAILS or k != "processor"}
        assert same == {k: upstream[mode][k] for k in same}, (mode, patched, upstream[mode])
    assert ["abort", ["req-1"]] in res["patched"]["cancel"]["engine"]
    assert res["patched"]["cancel-one-of-two"]["running"] == ["req-2"]  # the other request is left alone
    assert "cancelled submission(s) aborted in EngineCore" in res["status"]["reason"]
    assert "whose abort failed too (binding kept)" in res["status"]["reason"]


def test_the_fixed_release_aborts_and_the_patch_stays_out(fixed):
    assert fixed["status"]["state"] == "skipped:version" and "fixed upstream" in fixed["status"]["reason"]
    assert fixed["patched"] == fixed["stock"] == fixed["fixed_here"]  # the graft of its own function: itself
    for mode in REJECTED:
        assert ["abort", ["req-1"]] in fixed["stock"][mode]["engine"], mode
    assert fixed["stock"]["fail"]["running"] == fixed["stock"]["cancel"]["running"] == []


def test_0_20_0_has_the_same_defect_but_is_not_covered():
    """0.20.0 adds through ``self.clients[replica_id]``: no ``_llm_client`` to guard, so it is out of range."""
    res = case.release("0.20.0").call(case.scenario, case.MODES, False)
    _stock_leaves_it_running(res["stock"])
    assert res["status"]["state"] == "skipped:version", res["status"]
    assert res["patched"] == res["stock"]
