"""A warm parent for contract children: it imports torch once, then forks one child per check.

A contract check runs in its own interpreter so that the upstream files and stand-ins of one case never meet
another's. Most of a check's time was that interpreter importing torch (and torch's compiler stack, which vLLM's
config imports): the same files for every case, since every case runs this interpreter's torch. The zygote
imports those once; each check is a ``fork`` of it that then runs ``python -m omni_patches.testing.child ...``
as a fresh interpreter would (``runpy``, as ``__main__``). Nothing of omni-patches, vLLM or a case is imported
before the fork, so each child still imports its own targets, in its own order, from its own paths.

Protocol (one check at a time, JSON lines): the client writes ``{"argv": [...], "out": path, "err": path,
"timeout": s, "env": {...}}``; the zygote forks, the child writes its stdout/stderr to the two files, and the
zygote answers ``{"rc": exit status}`` (plus ``"timed_out": true`` when it killed a child that ran past
``timeout``). End of input ends the zygote.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

#: What every heavy check imports and no case provides itself. Best effort: an interpreter without torch (an
#: operator's overlay patch with no torch anywhere) still gets a zygote, with nothing preloaded.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.lowering", "torch._inductor.kernel.flex.flex_attention",
           "torch._inductor.standalone_compile", "numpy")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this interpreter lacks is simply not preloaded
            pass


def _child(argv: list, out: str, err: str, answers: int, env: dict | None) -> None:
    """In the forked child: become ``python -m omni_patches.testing.child <argv>`` and never return."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        os.close(answers)  # the zygote's answer pipe is not the child's to hold open
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        if env is not None:  # the check's own environment (the zygote's, bar what Zygotes.VOLATILE names)
            os.environ.clear()
            os.environ.update(env)
        sys.argv = ["-m", *map(str, argv)]
        try:
            runpy.run_module("omni_patches.testing.child", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter would print, and its exit status
            traceback.print_exc()
        atexit._run_exitfuncs()  # what an interpreter's exit runs (the proof writer removes its record)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"rc": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"rc": -signal.SIGKILL, "timed_out": True}
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def main() -> None:
    _preload()
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request["argv"], request["out"], request["err"], answers.fileno(), request.get("env"))
        answers.write(json.dumps(_wait(pid, float(request["timeout"]))) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
