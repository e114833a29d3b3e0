"""omni-diffusion-stage-init-deadline on the REAL diffusion stage launcher of every release in its range.

Each release runs in a child on its real ``stage_diffusion_proc.py`` and the real vLLM handshake of its line
(``case.release``): the real ``StageDiffusionProcManager`` starts the real ``run_diffusion_proc`` in a real process,
which answers vLLM's HELLO / init exchange and then hangs in the engine's start-up. Stock: the launcher is still
waiting after a deadline well past ``stage_init_timeout`` (measured), then the test kills the stage process.
Patched, in the same child: it raises after ``stage_init_timeout`` with the stage process terminated, exactly what
0.32.0rc1's own code does on the same inputs (exception type and message, its cause, the process's exit code); a
stage that becomes READY in time is handed back alive and left alone past the deadline; one that dies fails as
stock does.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from patches.omni_diffusion_stage_init_deadline import case

TIMEOUT = 1  # stage_init_timeout, seconds (the config's minimum)
STOCK_WAIT_S = 3.0  # 3x the timeout (from the stock launch's start): stock has not given up
PATCHED_WAIT_S = 30.0  # generous: the patched launcher ends at ~TIMEOUT
SETTLE_S = 5  # stage_init_timeout for the stages that die (see case.stock_then_patched)
SLACK_S = 5.0  # the patched launcher ends within TIMEOUT + this (2 shared cores)


def _outcome(run, text=True):
    """What a caller of the launcher sees, and what becomes of its stage process. Of the exception's cause only its
    type: its text is vLLM's, of the release's own vLLM line."""
    out = {k: run[k] for k in ("returned", "proc_alive", "exitcode", "engine_init_reached")}
    raised = run["raised"] if text or run["raised"] is None else run["raised"][0]
    return {**out, "raised": raised, "cause": run["cause"] and run["cause"][0]}


@pytest.fixture(scope="module")
def runs():
    versions = case.AFFECTED + case.FIXED + case.BEFORE
    for v in versions:  # built one after the other (the cache locks)
        case.release(v).paths()

    def one(v):
        if v in case.BEFORE:
            return v, case.release(v).call(case.own_handshake, TIMEOUT, timeout=300)
        return v, case.release(v).call(case.stock_then_patched, TIMEOUT, STOCK_WAIT_S, PATCHED_WAIT_S, SETTLE_S,
                                     timeout=300)

    with ThreadPoolExecutor(2) as pool:
        out = dict(pool.map(one, versions))
    for v, res in out.items():  # what was measured (pytest -s)
        if "stock" in res:
            print(f"\n{v}: stock still waiting at {res['stock']['waiting_after_s']}s, patched "
                  f"{(res['patched']['raised'] or ['returned'])[0]} after {res['patched']['seconds']}s; launches "
                  f"per sample: {[res[k]['attempts'] for k in ('stock', 'patched', 'patched_ready', 'patched_dies')]}"
                  f"; ready samples taken again (late): {res['patched_ready']['late_retries']}")
    return out


@pytest.mark.parametrize("version", case.AFFECTED)
def test_stock_waits_forever_and_the_patch_times_out_as_upstream_does(runs, version):
    res, fixed = runs[version], runs["0.32.0rc1"]
    assert res["status"]["state"] == "applied", res["status"]
    stock = res["stock"]
    assert stock["engine_init_reached"] is True  # HELLO / init done: the stage hangs in its engine start-up
    assert stock["waiting_after_s"] == STOCK_WAIT_S and stock["proc_alive"] is True, stock  # the hang, measured
    assert stock["raised"] is None and not stock["returned"]
    assert stock["cleanup_ended"] and stock["cleanup_raised"][0] == "RuntimeError"  # killed by the test: vLLM's error
    patched = res["patched"]
    assert patched["raised"] == ["TimeoutError", f"Diffusion stage process StageDiffusionProc did not become ready "
                                 f"within {TIMEOUT}s (stage_init_timeout); its processes were terminated"], patched
    assert TIMEOUT <= patched["seconds"] < TIMEOUT + SLACK_S, patched
    assert patched["proc_alive"] is False and patched["exitcode"] == 143  # SIGTERM: run_diffusion_proc's exit code
    assert _outcome(patched) == _outcome(fixed["stock"])  # 0.32.0rc1's own code, same inputs
    for name in ("patched_ready", "patched_dies"):  # vLLM's text names an exit code it may not have read yet
        assert _outcome(res[name], text=False) == _outcome(fixed[name], text=False), name
    assert res["patched_ready"]["returned"] is True and res["patched_ready"]["proc_alive"] is True
    assert res["patched_dies"]["raised"][0] == "RuntimeError" and res["patched_dies"]["exitcode"] == 1
    # every stage the patch ended counts: the hung one, and any launch started again (case.started)
    ended = res["patched"]["attempts"] + res["patched_ready"]["attempts"] - 1 + res["patched_dies"]["attempts"] - 1
    assert f"{ended} diffusion stage(s) not ready within stage_init_timeout" in res["status_after"]["reason"]


@pytest.mark.parametrize("version", case.FIXED)
def test_fixed_release_skips_and_bounds_the_wait_itself(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert res["stock"]["raised"][0] == "TimeoutError" and res["stock"]["proc_alive"] is False
    assert TIMEOUT <= res["stock"]["seconds"] < TIMEOUT + SLACK_S
    assert _outcome(res["patched"]) == _outcome(res["stock"])  # nothing bounded twice


@pytest.mark.parametrize("version", case.BEFORE)
def test_release_with_its_own_handshake_timeout_is_outside(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]
    assert res["has_manager"] is False
    assert res["raised"][0] == "TimeoutError" and "stage_init_timeout" in res["raised"][1], res
    assert TIMEOUT <= res["seconds"] < TIMEOUT + SLACK_S and res["proc_alive"] is False
