"""Drive the REAL ``AsyncOmni.sleep`` / ``wake_up`` of a vllm-omni release with real OmniACKs, stock then patched.

Usage: ``python -m patches.omni_diffusion_sleep_wake_errors.sleep_wake_child JSON`` in an interpreter whose
``sys.path`` starts with
:func:`support.omni_sleep_sandbox.paths` (real async_omni.py / async_omni_base.py, the release's real OmniACK).

An ``AsyncOmni`` is built with ``__new__`` (its ``__init__`` starts the whole engine) and given what sleep /
wake_up read: stage configs (``stage_type``), the pause condition, the release's real ``AsyncEventResolver``, and
``collective_rpc`` -- the RPC boundary -- which answers each diffusion stage with what the scenario says: a real
``OmniACK`` (in-process stage), its dict form (subprocess stage: ``dataclasses.asdict``), a subprocess RPC error
``{"error": True, "reason": ...}`` or StagePool's failed RPC ``{"supported": False, "error": ...}``, carrying the
task id of the real ``OmniSleepTask`` / ``OmniWakeTask`` it was sent. AR stages answer through
``_engine_core_rpc`` (recorded). Every scenario runs on a fresh instance in a fresh event loop; after each step
the child records the outcome (ACK summary or ``"Type: message"``), the sleep record, ``_level2_sleeping``,
``_paused``, ``is_sleeping()`` and the RPCs sent. Prints one ``RESULT {json}`` line.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import types

from support.omni_children import activate, child_main, status

PATCH_ID = "omni-diffusion-sleep-wake-errors"
MODULE = "vllm_omni.entrypoints.async_omni"
OOM = "CUDA Error: out of memory"

# name -> (stage types, steps); a step: (call, kwargs, {stage id: answer kind}) -- answers apply to diffusion RPCs.
SCENARIOS = {
    "wake_error": (["diffusion"], [("sleep", {"level": 1}, {0: "ok"}), ("wake_up", {}, {0: "error"}),
                                   ("wake_up", {}, {0: "ok"})]),
    "wake_error_dict": (["diffusion"], [("sleep", {"level": 1}, {0: "ok_dict"}), ("wake_up", {}, {0: "error_dict"})]),
    "wake_rpc_error": (["diffusion"], [("sleep", {"level": 1}, {0: "ok_dict"}), ("wake_up", {}, {0: "rpc_error"})]),
    "wake_unsupported": (["diffusion"], [("sleep", {"level": 1}, {0: "ok"}), ("wake_up", {}, {0: "unsupported"})]),
    "wake_ok": (["diffusion"], [("sleep", {"level": 1}, {0: "ok"}), ("wake_up", {}, {0: "ok_dict"})]),
    "sleep_error": (["diffusion"], [("sleep", {"level": 1}, {0: "error"}), ("wake_up", {}, {0: "ok"})]),
    "sleep_error_level2": (["diffusion"], [("sleep", {"level": 2}, {0: "error_dict"})]),
    "sleep_no_ack_level2": (["diffusion"], [("sleep", {"level": 2}, {0: None})]),
    "mixed_wake_error": (["llm", "diffusion"], [("sleep", {"level": 1}, {1: "ok"}), ("wake_up", {}, {1: "error"})]),
    "mixed_sleep_error": (["llm", "diffusion"], [("sleep", {"level": 2}, {1: "error"})]),
    "two_stages_wake_error": (["diffusion", "diffusion"], [("sleep", {"level": 1}, {0: "ok", 1: "ok"}),
                                                          ("wake_up", {}, {0: "ok", 1: "error"})]),
    "two_stages_first_fails": (["diffusion", "diffusion"], [("sleep", {"level": 1}, {0: "ok", 1: "ok"}),
                                                           ("wake_up", {}, {0: "error", 1: "ok"})]),
}


def _answer(module, kind, task, sid):
    ack_cls = module.OmniACK
    if kind is None:
        return None
    if kind in ("ok", "ok_dict"):
        ack = ack_cls(task_id=task.task_id, status="SUCCESS", stage_id=sid, rank=0, freed_bytes=1 << 20)
        return ack if kind == "ok" else dataclasses.asdict(ack)
    if kind in ("error", "error_dict"):
        ack = ack_cls(task_id=task.task_id, status="ERROR", stage_id=sid, rank=0, error_msg=OOM)
        return ack if kind == "error" else dataclasses.asdict(ack)
    if kind == "rpc_error":
        return {"error": True, "reason": f"StageDiffusionProc rpc failed on stage {sid}"}
    if kind == "unsupported":
        return {"supported": False, "error": "EngineDeadError: stage replica is gone"}
    raise ValueError(kind)


def _resolver_cls(module):
    cls = getattr(module, "AsyncEventResolver", None)
    if cls is None:
        cls = importlib.import_module("vllm_omni.entrypoints.async_omni_base").AsyncEventResolver
    return cls


def _summary(value):
    if isinstance(value, list):
        return [_summary(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {"OmniACK": [value.status, value.stage_id, value.error_msg]}
    if isinstance(value, dict):
        return {"dict": sorted((k, repr(v)) for k, v in value.items() if k not in ("task_id", "metadata"))}
    return repr(value)


def build(module, stage_types, answer):
    """A real ``AsyncOmni`` (``__new__``) with what sleep / wake_up read; ``answer(task, stage id)`` is what a
    diffusion stage answers the RPC with. Returns ``(instance, list of the RPCs sent)``."""
    omni = module.AsyncOmni.__new__(module.AsyncOmni)
    rpcs = []
    stages = [types.SimpleNamespace(stage_type=t) for t in stage_types]

    async def collective_rpc(method, timeout=None, args=(), kwargs=None, stage_ids=None):
        rpcs.append([method, list(stage_ids)])
        return [answer(args[0], sid) for sid in stage_ids]

    async def engine_core_rpc(method, stage_ids=None, args=(), kwargs=None, timeout=None):
        rpcs.append([f"engine_core:{method}", list(stage_ids)])

    async def noop(*args, **kwargs):
        return None

    omni.__dict__.update(
        # stage types: 0.30.0rc1+ read engine.stage_configs, 0.28.0-0.29.0rc1 engine.stage_clients
        _name="AsyncOmni", engine=types.SimpleNamespace(stage_configs=stages, stage_clients=stages),
        _pause_cond=asyncio.Condition(), _paused=False, event_resolver=_resolver_cls(module)(orchestrator=None),
        collective_rpc=collective_rpc, _engine_core_rpc=engine_core_rpc, _final_output_handler=lambda: None,
        _clear_frontend_mm_cache=noop, reset_mm_cache=noop)
    return omni, rpcs


async def _scenario(module, stage_types, steps):
    answers = {}
    omni, rpcs = build(module, stage_types, lambda task, sid: _answer(module, answers.get(sid), task, sid))
    out = []
    for call, kwargs, step_answers in steps:
        answers.clear()
        answers.update(step_answers)
        rpcs.clear()
        try:
            outcome = {"returned": _summary(await getattr(omni, call)(**kwargs))}
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome = {"raised": f"{type(exc).__name__}: {exc}"}
        per_stage = getattr(omni, "_stage_sleeping_tags", None) or {}
        out.append({"call": call, **outcome, "rpcs": list(rpcs),
                    "stage_tags": {str(k): sorted(v) for k, v in sorted(per_stage.items())},
                    "tags": sorted(getattr(omni, "_sleeping_tags", set())),
                    "level2": bool(getattr(omni, "_level2_sleeping", False)), "paused": bool(omni._paused),
                    "is_sleeping": await omni.is_sleeping()})
    return out


def run_all(module):
    return {name: asyncio.run(_scenario(module, types_, steps)) for name, (types_, steps) in SCENARIOS.items()}


def main(job):
    module = importlib.import_module(MODULE)
    res = {"file": module.__file__, "stock": run_all(module)}
    res["status"] = activate(PATCH_ID, job.get("env"))
    res["patched"] = run_all(module)
    res["status_after"] = status(PATCH_ID)
    return res


if __name__ == "__main__":
    child_main(main)
