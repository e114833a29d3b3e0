"""Watch the production state directory for records written by *this* test session's processes.

Every process the suite starts must record into the session's own ``OMNI_PATCHES_STATE_DIR``. Other processes of
the same user (a real server, another checkout's tests) may legitimately write into the production directory
while the suite runs, so "the directory did not change" is the wrong check. Instead, a record there is the
suite's when it was written by a process of the suite:

- its process (pid + start time, which together name one process since boot) was seen as a descendant of the
  pytest process by a poller that walks ``/proc`` once a second, or its parent was; or
- it carries an instance id that one of the suite's own records carries (an instance is inherited by children).

Only records created or rewritten after the session started are looked at.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


def _stat_fields(pid: int):
    """(ppid, start time in clock ticks) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> dict[int, int]:
    """{pid: start ticks} of every live descendant of ``root``."""
    parent_of, start_of = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _stat_fields(int(name))
            if got is not None:
                parent_of[int(name)], start_of[int(name)] = got
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out[child] = start_of[child]
                todo.append(child)
    return out


def _records(directory) -> dict[str, tuple[int, dict]]:
    """{file name: (mtime_ns, record)} of the JSON records in ``directory`` (unreadable ones as {})."""
    out = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return out
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        try:
            mtime = entry.stat().st_mtime_ns
            rec = json.loads(Path(entry.path).read_text())
        except (OSError, ValueError):
            continue
        out[entry.name] = (mtime, rec if isinstance(rec, dict) else {})
    return out


class StateGuard:
    def __init__(self, production_dir, session_dir, interval: float = 1.0):
        self.production_dir, self.session_dir = str(production_dir), str(session_dir)
        self.root = os.getpid()
        self.before = {name: mtime for name, (mtime, _) in _records(self.production_dir).items()}
        self.seen: set[tuple[int, int]] = set()  # (pid, start ticks) of the suite's processes
        self.seen_pids: set[int] = set()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="omni-state-guard", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self._interval):
            self.poll()

    def poll(self):
        try:
            found = descendants(self.root)
        except OSError:  # pragma: no cover - /proc unreadable
            return
        self.seen.update(found.items())
        self.seen_pids.update(found)

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.poll()

    def session_instances(self) -> set[str]:
        """Instance ids of the session's records: its directory and, under pytest-xdist, the workers' in it."""
        dirs = [self.session_dir, *(e.path for e in os.scandir(self.session_dir) if e.is_dir())] \
            if os.path.isdir(self.session_dir) else []
        return {rec.get("instance") for d in dirs for _, rec in _records(d).values() if rec.get("instance")}

    def leaked(self) -> list[dict]:
        """Records in the production directory, new or rewritten since the start, that a suite process wrote."""
        instances = self.session_instances()
        out = []
        for name, (mtime, rec) in _records(self.production_dir).items():
            if self.before.get(name) == mtime:
                continue
            pid, start, ppid = rec.get("pid"), rec.get("start"), rec.get("ppid")
            why = []
            if (pid, start) in self.seen:
                why.append(f"pid {pid} was a process of the suite")
            if (ppid in self.seen_pids or ppid == self.root) and ppid != 1:
                why.append(f"its parent {ppid} was a process of the suite")
            if pid == self.root:
                why.append("it is the pytest process itself")
            if rec.get("instance") in instances:
                why.append(f"instance {rec.get('instance')} is one of the suite's")
            if why:
                out.append({"file": name, "role": rec.get("role"), "why": why, "at": time.ctime(mtime / 1e9)})
        return out
