"""omni-sleep-validate-first on the REAL AsyncOmni.sleep of every release in its range, and on the real
POST /v1/omni/sleep of the stacks.

Engine (``case.run`` in a child per release, ``release(v).call``: the real ``async_omni.py`` from the PyPI wheel,
stand-ins for the rest, ``support.omni_sleep_sandbox``): a sleep with a bad stage id, the wake_up an operator tries
next, then a valid sleep and wake_up; after each step whether generate() would be admitted. Stock first, then the shim activated in the same
process. 0.32.0rc1 (upstream's order: check, then close admission) runs the same steps: every patched release must
give exactly its outcomes.

API (``case.http_main`` in the stack's own interpreter, the shim installed as an operator has it): the router's real
endpoint of 0.30.0 (the newest final) and 0.32.0rc1, a bad id each; stock lets the ValueError out (the server's
handlers answer it) with admission closed, the patched endpoint raises 0.32.0rc1's HTTPException(400) with its message.
A whole server of each: tests/test_serving.py.
"""
import pytest

from patches.omni_sleep_validate_first import case
from support import serving
from support.omni_children import collect, start
from support.omni_sleep_sandbox import release
from support.wheels import fetch_or_skip

RELEASES = [*case.AFFECTED, case.FIXED]
HTTP = ["0.30.0", case.FIXED]  # the newest final, and upstream's fixed release (stacks of the serving tier)
WEDGED = {"admits": False, "paused": True}


def _invalid(bad):
    return f"ValueError: Invalid stage_ids {[bad[0]]}; valid range is 0..0"


@pytest.fixture(scope="module")
def runs():
    out = {}
    for v in RELEASES:
        fetch_or_skip("vllm-omni", v)
        out[v] = release(v).call(case.run)
    return out


@pytest.mark.parametrize("version", case.AFFECTED)
def test_stock_wedges_admission_and_the_patch_refuses_first_as_upstream_does(runs, version):
    res, fixed = runs[version], runs[case.FIXED]["stock"]
    assert res["file"].endswith(case.ASYNC_OMNI)
    for bad in map(str, case.BAD):
        sleep, wake, again, woken = res["stock"][bad]
        # Stock: the id check fails after admission closed; the wake_up that follows finds nothing asleep and
        # leaves it closed; only a valid sleep and wake_up reopen it.
        assert sleep["raised"].startswith("ValueError: Invalid stage_ids") and sleep["rpcs"] == [], sleep
        assert {k: sleep[k] for k in WEDGED} == WEDGED and {k: wake[k] for k in WEDGED} == WEDGED, (sleep, wake)
        assert wake["returned"] == [] and again["returned"] == ["SUCCESS"] and woken["admits"], (wake, woken)
    assert res["status"]["state"] == "applied", res["status"]
    assert res["patched"] == fixed  # every step: what was raised or returned, the RPCs, admission, the record
    for bad in map(str, case.BAD):
        sleep = res["patched"][bad][0]
        assert sleep["raised"].startswith("ValueError") and sleep["admits"] and not sleep["paused"], sleep
    assert "sleep requests refused before closing admission (bad stage ids): 3" in res["status_after"]["reason"]


def test_fixed_release_skips_and_refuses_first_itself(runs):
    res = runs[case.FIXED]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert res["stock"]["[5]"][0]["raised"] == _invalid([5]) and res["stock"]["[5]"][0]["admits"]
    assert res["patched"] == res["stock"]


@pytest.fixture(scope="module")
def http(shimmed_stack, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    procs = {v: start("patches.omni_sleep_validate_first.case", {}, state / v,
                      serving.server_path(v).split(":"), python=shimmed_stack(v), installed=True) for v in HTTP}
    return {v: collect(p, timeout=600) for v, p in procs.items()}


@pytest.mark.stack
def test_api_answers_a_bad_id_with_upstreams_400_and_leaves_admission_open(http):
    stock, fixed = http["0.30.0"], http[case.FIXED]
    assert stock["file"].endswith("vllm_omni/entrypoints/openai/api_server.py")
    for bad in case.HTTP_BAD:
        got = stock["stock"][str(bad)]
        assert got["raised"] == _invalid(bad) and got["paused"], got  # wedged
        want = fixed["stock"][str(bad)]
        assert want == {"status": 400, "detail": _invalid(bad)[len("ValueError: "):], "paused": False,
                        "api_sleeping": []}, want
        assert stock["patched"][str(bad)] == want
    assert stock["status"]["state"] == "applied", stock["status"]
    assert "sleep requests answered 400 (bad stage ids): 2" in stock["status_after"]["reason"]
    assert fixed["status"]["state"] == "skipped:version" and fixed["patched"] == fixed["stock"]
