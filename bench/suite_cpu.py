#!/usr/bin/env python
"""Where the test suite's CPU goes: run pytest and charge every process it starts to the test that started it.

    python bench/suite_cpu.py                       # the README's test command (python -m pytest)
    python bench/suite_cpu.py -- -m "not stack"     # pytest arguments after --
    python bench/suite_cpu.py --top 40 --json out.json

Linux only. Every half second it reads ``/proc``: each descendant of the pytest process (a worker, a contract
child, a server and its stage processes, a gloo rank) is charged, by its user + system CPU time, to the
``PYTEST_CURRENT_TEST`` its environment started with -- pytest names the running test there, and children inherit
it; a process that started with no test in its environment (Ray's nodes start from an empty one) goes to the test of
the process it was found under. A child forked from a zygote (``omni_patches.testing.zygote``) keeps the zygote's
start-up environment, so it is charged to the test that started its zygote (shown as ``zygote`` in the kind column).
A process once seen stays watched after it leaves the tree (a daemon re-parented when its parent exits, as ``ray
start``'s are), and so do the processes it starts later; one that leaves the tree before the first half-second
sample sees it is missed, and CPU a process spends in the last half second before it exits is lost: the whole
machine's busy time (``/proc/stat``) is printed beside the charge, so what was missed shows. The wall time goes
beside the CPU time: ``CPU / (wall x cores)`` is how busy the machine was, and ``CPU / cores`` the shortest wall
time this much work allows. The pytest processes (the controller and xdist workers) are charged to no test.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: int):
    """(parent pid, start ticks, CPU seconds) of ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ


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
    """Update ``seen`` {(pid, start): [test, kind, cpu, command line]} with ``root``, every live descendant of it,
    and every live process seen before (its pid and start ticks name it) with its descendants. A process is met
    after its parent, and one whose environment names no test takes its parent's."""
    table = {}  # pid: (parent pid, start ticks, CPU seconds), one walk of /proc
    for name in os.listdir("/proc"):
        if name.isdigit() and (got := _stat(int(name))) is not None:
            table[int(name)] = got
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = collections.deque([root, *(pid for pid, start in seen if pid in table and table[pid][1] == start)])
    visited = set()
    while todo:
        pid = todo.popleft()
        if pid in visited or pid not in table:
            continue
        visited.add(pid)
        ppid, start, cpu = table[pid]
        entry = seen.get((pid, start))
        if entry is None:
            test, cmd = _started_as(pid)
            if not test and ppid in table:
                test = seen.get((ppid, table[ppid][1]), [""])[0]
            seen[(pid, start)] = [test, _kind(cmd), cpu, cmd.rstrip()[:400]]
        else:
            entry[2] = cpu
        todo.extend(children.get(pid, ()))


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
          f"seen, CPU lost at exits, this sampler, anything else on the machine")
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
