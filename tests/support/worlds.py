"""What the gloo world drivers (``ep_world``, ``ascend_finalize_world``) share: a loopback port, and collecting
one result per rank without ever hanging on a rank that died or waits in a collective a peer left."""
from __future__ import annotations

import json
import os
import queue as _queue
import socket
import sys
import time


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
