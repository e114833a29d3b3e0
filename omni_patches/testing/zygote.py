"""A warm parent for test children: it imports torch once, then forks one child per request.

A contract check (or a test's scenario) runs in its own interpreter so that the upstream files and stand-ins of
one case never meet another's. Most of such a child's time was that interpreter importing torch (and torch's
compiler stack, which vLLM's config imports): the same files for every case, since every case runs this
interpreter's torch. The zygote imports those once; each request is a ``fork`` of it that then runs as a fresh
interpreter would: ``python -m omni_patches.testing.child ARGV`` (``runpy``, as ``__main__``) or ``python -c
CODE ARGV``, with the request's environment and ``sys.path`` rebuilt from its ``PYTHONPATH`` the way the
interpreter builds it at start. Nothing of vLLM or a case is imported before the fork, so each child still
imports its own targets, in its own order, from its own paths.

Protocol (one request at a time, JSON lines): the client writes ``{"argv": [...], "out": path, "err": path,
"timeout": s, "env": {...}, "cwd": dir}`` (plus ``"code"`` for ``-c``); the zygote forks, the child writes its
stdout/stderr to the two files, and the zygote answers ``{"rc": exit status}`` (plus ``"timed_out": true`` when
it killed a child that ran past ``timeout``). End of input ends the zygote. Start it with no ``PYTHONPATH``: the path it
starts with is every child's base.
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


#: ``{"paths": [dir, ...], "modules": [name, ...]}`` (JSON) in a zygote's start environment: third-party modules
#: that the children import from those directories (a release's deps, never its own package), imported once here
#: with the directories first on ``sys.path``, which is then restored. Each child must have the same directories on
#: its own path by the time it imports them: :func:`verify_preloaded` checks it (:mod:`omni_patches.testing.child`
#: after its environment's paths are in place, a ``-c`` child at once).
PRELOAD_ENV = "OMNI_TESTING_PRELOAD"

#: Top-level module -> the file it was loaded from, for every module the extra preload loaded from its directories.
PRELOADED: dict = {}


def _import_all(names) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this interpreter lacks is simply not preloaded
            pass


def _preload() -> None:
    _import_all(PRELOAD)
    extra = os.environ.get(PRELOAD_ENV)
    if not extra:
        return
    spec = json.loads(extra)
    dirs = [os.path.abspath(p) for p in spec.get("paths", [])]
    saved = list(sys.path)
    sys.path[:0] = dirs
    try:
        _import_all(spec.get("modules", []))
    finally:
        sys.path[:] = saved
    roots = tuple(os.path.join(d, "") for d in dirs)
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if "." not in name and origin and os.path.abspath(origin).startswith(roots):
            PRELOADED[name] = os.path.abspath(origin)


def verify_preloaded() -> None:
    """Raise unless every module the extra preload loaded is what ``sys.path`` would load: a child that would find
    another copy of it (or none) cannot run as a fresh interpreter would in this zygote."""
    from importlib.machinery import PathFinder

    for name, origin in PRELOADED.items():
        found = PathFinder.find_spec(name, sys.path)
        if found is None or not found.origin or os.path.abspath(found.origin) != origin:
            raise RuntimeError(f"{PRELOAD_ENV}: this zygote preloaded {name} from {origin}, but this child's path "
                               f"would import {found.origin if found else 'nothing'}: preload only what the "
                               "child's own path provides")


#: The zygote's ``sys.path`` after the first entry (the script's or module's directory) when it started:
#: what an interpreter started with no ``PYTHONPATH`` has; each child puts its own ``PYTHONPATH`` in front.
_BASE: list = []


def _child_path(env: dict, first: str) -> list:
    """``sys.path`` of ``python`` started with ``env``: ``first``, then ``PYTHONPATH`` (absolute; an empty entry is
    the working directory) and the base, each directory once (``site`` drops repeats)."""
    extra = env.get("PYTHONPATH", "")
    entries = [os.path.abspath(p) for p in extra.split(os.pathsep)] if extra else []
    seen, out = set(), []
    for p in entries + _BASE:
        key = os.path.normcase(os.path.abspath(p))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return [first, *out]


def _child(request: dict, answers: int) -> None:
    """In the forked child: become ``python -m omni_patches.testing.child ARGV`` (``python -c CODE ARGV`` when the
    request has ``code``) and never return."""
    import atexit
    import importlib
    import runpy
    import traceback
    import types

    code = 1
    try:
        os.close(answers)  # the zygote's answer pipe is not the child's to hold open
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        env = request.get("env")
        if env is not None:  # the request's own environment
            os.environ.clear()
            os.environ.update(env)
        argv = [str(a) for a in request["argv"]]
        program = request.get("code")
        try:
            if request.get("cwd"):  # by name: the directory may have been made anew since the zygote started
                os.chdir(request["cwd"])
            sys.path[:] = _child_path(os.environ, "" if program is not None else os.getcwd())
            importlib.invalidate_caches()
            if program is not None:  # its path is complete now (a contract child's, once its environment is set)
                verify_preloaded()
            if program is None:
                sys.argv = ["-m", *argv]
                runpy.run_module("omni_patches.testing.child", run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c", *argv]
                main = types.ModuleType("__main__")
                main.__builtins__ = __builtins__
                sys.modules["__main__"] = main
                exec(compile(program, "<string>", "exec"), main.__dict__)
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
    _BASE[:] = sys.path[1:]
    _preload()
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, answers.fileno())
        answers.write(json.dumps(_wait(pid, float(request["timeout"]))) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
