"""omni-stage-executor-failure-teardown on the REAL StageDiffusionProc.run_loop of every release in its range.

Each release runs in its own interpreter (``executor_failure_child``): the real
``stage_diffusion_proc.py`` from the PyPI wheel (permissive stand-ins around it, real pyzmq), run_loop serving a
client's sockets, and an executor that fails as ``MultiprocDiffusionExecutor``'s worker monitor does (``is_dead``,
then the registered failure callbacks from the monitor's thread) while no request is in flight, or before run_loop
starts. Stock first, then the shim activated in the same process; 0.31.0rc1 / 0.32.0rc1 (upstream's
``_watch_executor_failure``) run the same scenarios.
"""
import pytest

from patches.omni_stage_executor_failure_teardown import executor_failure_child as child
from support.omni_children import run_children

STOCK_WAIT_S = 2.0  # stock never tears down without a request: any bound shows it
AFFECTED = ["0.22.0", "0.23.0rc1", "0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0", "0.27.0rc1",
            "0.28.0rc1", "0.28.0", "0.29.0rc1", "0.30.0rc1", "0.30.0"]
FIXED = ["0.31.0rc1", "0.32.0rc1"]
BEFORE = ["0.21.0rc1"]  # no fatal-failure teardown in run_loop at all
SCENARIOS = ("", "_dead_before")


def _outcome(run):
    return {k: run[k] for k in ("callbacks_registered", "torn_down", "ended", "dead_sentinel")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = [(v, v, {"stock_wait": STOCK_WAIT_S}) for v in AFFECTED + FIXED + BEFORE]
    return run_children("executor-failure", child.__name__, jobs, child.paths, tmp_path_factory.mktemp("state"))


@pytest.mark.parametrize("version", AFFECTED)
def test_stock_stays_up_and_the_patch_tears_down_as_upstream_does(runs, version):
    res, fixed = runs[version], runs["0.31.0rc1"]
    assert res["status"]["state"] == "applied", res["status"]
    for scenario in SCENARIOS:
        stock, patched = res["stock" + scenario], res["patched" + scenario]
        assert stock["callbacks_registered"] == 0 and stock["torn_down"] is False, (scenario, stock)
        assert not stock["dead_sentinel"]
        assert patched["torn_down"] is True and patched["dead_sentinel"] is True, (scenario, patched)
        assert _outcome(patched) == _outcome(fixed["stock" + scenario]), scenario
    assert "1 stage process(es) torn down at once" in res["status_after"]["reason"]


@pytest.mark.parametrize("version", FIXED)
def test_fixed_release_skips(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    for scenario in SCENARIOS:
        assert res["stock" + scenario]["torn_down"] is True
        assert _outcome(res["patched" + scenario]) == _outcome(res["stock" + scenario])  # nothing registered twice


@pytest.mark.parametrize("version", BEFORE)
def test_release_without_fatal_teardown_is_outside(runs, version):
    res = runs[version]
    assert res["status"]["state"] == "skipped:version" and "outside" in res["status"]["reason"]
    assert res["stock"]["torn_down"] is False
