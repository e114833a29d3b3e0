#!/usr/bin/env python
"""Where the test suite's CPU goes: run pytest and charge every process it starts to the test that started it.

    python bench/suite_cpu.py                       # the README's test command (python -m pytest)
    python bench/suite_cpu.py -- -m "not stack"     # pytest arguments after --
    python bench/suite_cpu.py --top 40 --json out.json

Linux only. Every half second it reads ``/proc``: each descendant of the pytest process (a worker, a contract
child, a server and its stage processes, a gloo rank) is charged, by its user + system CPU time, to the
``PYTEST_CURRENT_TEST`` its environment started with -- pytest names the running test there, and children inherit
it. A child forked from a zygote (``omni_patches.testing.zygote``) keeps the zygote's start-up environment, so it
is charged to the test that started its zygote (shown as ``zygote`` in the kind column). Processes that leave the
tree (a daemon re-parented to init) are charged while they are seen in it; CPU a process spends in the last half
second before it exits is lost; the whole machine's busy time (``/proc/stat``) is printed beside the charge, so
what was missed shows. The wall time goes beside the CPU time: ``CPU / (wall x cores)`` is how busy
the machine was, and ``CPU / cores`` the shortest wall time this much work allows. The pytest processes (the
controller and xdist workers) are charged to no test.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.state_guard import descendants  # noqa: E402 - the suite's own walk of /proc (its state guard)

HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: int):
    """(start ticks, CPU seconds) of ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ


def _started_as(pid: int) -> tuple[str, str]:
    """(the test in the environment the process started with, its command line)."""
    test = ""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            for item in fh.read().split(b"\0"):
                if item.startswith(b"PYTEST_CURRENT_TEST="):
                    test = item[len(b"PYTEST_CURRENT_TEST="):].decode(errors="replace").rsplit(" ", 1)[0]
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = ""
    return test, cmd


def _kind(cmd: str) -> str:
    if "testing import zygote" in cmd:
        return "zygote"
    if "omni-patches-tests/venvs/" in cmd:
        return "stack"
    if "forkserver" in cmd:
        return "forkserver"
    if "pytest" in cmd or "execnet" in cmd or "exec(eval(sys.stdin" in cmd:
        return "pytest"
    return "python" if "python" in cmd else "other"


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``: user, nice, system, irq,
    softirq, steal), for what the per-process charge misses."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / HZ


def sample(root: int, seen: dict) -> None:
    """Update ``seen`` {(pid, start): [test, kind, cpu, command line]} with ``root`` and every live descendant."""
    for pid in [root, *descendants(root)]:
        got = _stat(pid)
        if got is None:
            continue
        start, cpu = got
        entry = seen.get((pid, start))
        if entry is None:
            test, cmd = _started_as(pid)
            seen[(pid, start)] = [test, _kind(cmd), cpu, cmd.rstrip()[:400]]
        else:
            entry[2] = cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=30, help="test files shown (default 30)")
    ap.add_argument("--json", help="also write every process's charge (and command line) here")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to python -m pytest")
    args = ap.parse_args()
    started, machine_before = time.monotonic(), machine_cpu()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args.pytest_args])
    seen: dict = {}
    while proc.poll() is None:
        sample(proc.pid, seen)
        time.sleep(0.5)
    wall, machine = time.monotonic() - started, machine_cpu() - machine_before
    by_file, by_kind, count = collections.Counter(), collections.Counter(), collections.Counter()
    for test, kind, cpu, _ in seen.values():
        where = test.split("::")[0] if test else "(no test: workers, collection, session fixtures)"
        by_file[where] += cpu
        by_kind[kind] += cpu
        count[where] += 1
    charged = sum(by_file.values())
    cores = os.cpu_count() or 1
    print(f"\n===== suite CPU: pytest exit {proc.returncode}, wall {wall / 60:.1f} min, {cores} cores")
    print(f"charged: {charged / 60:.1f} CPU-min; machine busy {100 * charged / (wall * cores):.0f}%; this work "
          f"needs >= {charged / cores / 60:.1f} min of wall time on {cores} cores")
    print(f"the whole machine: {machine / 60:.1f} CPU-min busy ({100 * machine / (wall * cores):.0f}%); "
          f"{max(machine - charged, 0) / 60:.1f} of them uncharged: processes that left the tree before they were "
          f"seen (Ray's daemons and workers), CPU lost at exits, this sampler, anything else on the machine")
    print("by kind: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in by_kind.most_common()))
    print("| CPU-min | processes | test file |\n|---:|---:|---|")
    for where, cpu in by_file.most_common(args.top):
        print(f"| {cpu / 60:.2f} | {count[where]} | {where} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{"pid": pid, "start": start, "test": t, "kind": k, "cpu_s": c, "cmd": cmd}
                       for (pid, start), (t, k, c, cmd) in seen.items()], fh)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
