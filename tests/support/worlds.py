"""The gloo world driver of the multi-rank tiers (the EP tier's ``support.ep_world``, the Ascend finalize world):
N ranks per world, forked from one forkserver that imported the heavy modules once, on loopback only, one result
per rank collected without ever hanging on a rank that died or waits in a collective a peer left.

:func:`run_worlds` starts one driver process (``python -m support.worlds``, fresh: nothing inherited from pytest).
For each world it runs ``prepare`` (``"module:function"``, in the driver: ``params`` in, ``params`` out), then
``world_size`` ranks; each rank puts ``paths`` first on ``sys.path``, sets ``RANK`` / ``WORLD_SIZE`` /
``MASTER_PORT``, runs the world's ``setup`` hooks and ``scenario(rank, world_size, params)``, and reports one dict
(its return value, or ``error`` + ``traceback``).
"""
from __future__ import annotations

import importlib
import json
import os
import queue as _queue
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # `support`, `patches`: the one import root of the test code
MARKER = "@@WORLDS@@"
_PRELOAD_ENV = "OMNI_TEST_WORLD_PRELOAD"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather(procs, results_queue, timeout_s: float, *, t0: float, grace_after_error: float | None = None) -> list[dict]:
    """Each rank's dict (``{"rank": r, ...}``) from ``results_queue``, in rank order.

    Stops when every rank answered, every process is gone, or ``timeout_s`` passed -- sooner, ``grace_after_error``
    seconds after a rank reported an ``error`` (its peers would wait in the collective it left). Stragglers are
    killed and stand in as an ``error`` entry; every entry carries the world's wall time since ``t0``."""
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            item = results_queue.get(timeout=0.5)
        except _queue.Empty:
            if all(not p.is_alive() for p in procs) and results_queue.empty():
                break
            continue
        results[item["rank"]] = item
        if "error" in item and grace_after_error is not None:
            deadline = min(deadline, time.monotonic() + grace_after_error)
    for r, p in enumerate(procs):
        p.join(timeout=2 if r in results else 0.1)
        if p.is_alive():
            p.kill()
        results.setdefault(r, {"rank": r, "error": f"rank {r} gave no result (exitcode={p.exitcode}, timeout?)"})
    wall = round(time.perf_counter() - t0, 2)
    for item in results.values():
        item["world_wall_s"] = wall
    return [results[r] for r in range(len(procs))]


def report_and_exit(results_queue, out: dict) -> None:
    """A rank's last act: send ``out`` (JSON-safe) and leave without interpreter teardown, which gloo groups
    left alive can stall for seconds."""
    results_queue.put(json.loads(json.dumps(out, default=repr)))
    results_queue.close()
    results_queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worlds(paths, worlds: list[dict], *, preload=(), timeout: float = 300, world_timeout: float | None = None,
               grace_after_error: float = 20.0) -> list:
    """Each world's per-rank dicts, in order. ``worlds``: dicts with ``world_size``, ``scenario`` and ``params``,
    optionally ``setup`` (hooks) and ``prepare``. ``preload``: modules the forkserver imports once for all ranks.
    ``timeout`` bounds the whole run (the driver's own bound ends 45 s sooner, so it always gets to report which
    rank did what), ``world_timeout`` one world (a world whose ranks wait in a collective forever ends as "gave
    no result", so the caller can tell a transport failure and run it again). The driver's environment: this one's
    without the shim's switches; loopback only, one OpenMP thread. Ranks are forks of a forkserver (~4x faster on
    2 cores than spawning each)."""
    from support.venvs import without_switches

    job = {"worlds": [{"setup": [], **w, "port": free_port()} for w in worlds],
           "sys_path": [str(TESTS), *map(str, paths)], "preload": list(preload),
           "rank_timeout": timeout - 45, "world_timeout": world_timeout or timeout, "grace": grace_after_error}
    full = {k: v for k, v in without_switches().items() if not k.startswith(("PYTEST_", "VLLM_PLUGINS"))}
    full.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS), "TOKENIZERS_PARALLELISM": "false",
                 "VLLM_LOGGING_LEVEL": full.get("VLLM_LOGGING_LEVEL", "ERROR"),
                 "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})  # loopback only
    proc = subprocess.run([sys.executable, "-m", "support.worlds"], input=json.dumps(job), capture_output=True,
                          text=True, env=full, timeout=timeout, cwd=str(TESTS.parent))
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RuntimeError(f"world driver failed rc={proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                       f"STDERR:\n{proc.stderr[-6000:]}")


def _front(paths) -> None:
    sys.path[:0] = [p for p in paths if p not in sys.path]


def _resolve(qualname: str):
    mod, _, fn = qualname.partition(":")
    obj = importlib.import_module(mod)
    for part in fn.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(rank: int, job: dict, results_queue) -> None:
    out: dict = {"rank": rank}
    try:
        _front(job["sys_path"])
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"]), "RANK": str(rank),
                           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job["world_size"])})
        for qualname in job["setup"]:
            _resolve(qualname)()
        t0 = time.perf_counter()
        out.update(_resolve(job["scenario"])(rank, job["world_size"], job["params"]) or {})
        out["scenario_s"] = round(time.perf_counter() - t0, 3)
    except BaseException as exc:  # report, never hang the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
    report_and_exit(results_queue, out)


def _driver() -> None:
    import multiprocessing as mp

    job = json.loads(sys.stdin.read())
    _front(job["sys_path"])
    ctx = mp.get_context("forkserver")
    os.environ[_PRELOAD_ENV] = json.dumps([job["sys_path"], job["preload"]])
    ctx.set_forkserver_preload(["support.worlds"])
    deadline = time.monotonic() + job["rank_timeout"]
    all_results = []
    for world in job["worlds"]:
        wjob = {**job, **world}
        if world.get("prepare"):
            wjob["params"] = _resolve(world["prepare"])(wjob["params"])
        results_queue = ctx.Queue()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=_rank_main, args=(r, wjob, results_queue), daemon=True)
                 for r in range(wjob["world_size"])]
        for proc in procs:
            proc.start()
        bound = min(job["world_timeout"], max(5.0, deadline - time.monotonic()))
        all_results.append(gather(procs, results_queue, bound, t0=t0, grace_after_error=job["grace"]))
    print(MARKER + json.dumps(all_results), flush=True)


if __name__ == "__main__":
    _driver()
elif __name__ == "support.worlds" and os.environ.get(_PRELOAD_ENV):  # the forkserver: paths, then the heavy imports
    _paths, _modules = json.loads(os.environ[_PRELOAD_ENV])
    _front(_paths)
    for _module in _modules:
        importlib.import_module(_module)
