"""Spawned child for tests/test_proof*.py: activate the shim, import a fake target, wait to be told to exit.

"Exit" is a file, not a multiprocessing.Event: a sibling killed with SIGKILL while sleeping in Event.wait()
never acknowledges Event.set(), which would then block the parent forever.
"""
import importlib
import os
import time
from pathlib import Path


def start_workers(ctx, count, main, *args):
    """``count`` children named ``VllmWorker-<rank>`` (as vLLM names its workers) of the multiprocessing context
    ``ctx``, each running ``main(ready, *args)``; returns ``(processes, their ready events)``."""
    procs, readies = [], []
    for rank in range(count):
        ready = ctx.Event()
        proc = ctx.Process(target=main, args=(ready, *args), name=f"VllmWorker-{rank}")
        proc.start()
        procs.append(proc)
        readies.append(ready)
    return procs, readies


def stop_workers(procs, stop_file):
    """Tell the children to exit (the stop file) and wait for them; kill one that does not."""
    Path(stop_file).touch()
    for proc in procs:
        proc.join(30)
        if proc.is_alive():  # pragma: no cover
            proc.kill()
            proc.join(10)


def serve(ready, stop_file, target):
    import omni_patches

    omni_patches.activate()
    importlib.import_module(target)  # the fake patch applies here; proof records this process
    ready.set()
    deadline = time.monotonic() + 60
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)


def worker(ready, stop_file, target, env, paths, chdir_to=None, report=None):
    """A vLLM-like worker for tests/test_proof_readers.py, started with any start method (fork, forkserver,
    spawn). ``env`` and ``paths`` are applied first: a forkserver child inherits the environment and sys.path
    of the fork server, which may have been started by an earlier test. Returns normally: exit code 0."""
    import sys

    os.environ.update(env)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import omni_patches

    omni_patches.activate()
    importlib.import_module(target)  # in a fork child already imported (patched in the parent): a no-op
    if chdir_to is not None:
        os.chdir(chdir_to)  # the host changes its working directory after it recorded itself
    if report is not None:  # a file: what the children of this host would inherit
        with open(report, "w") as fh:
            fh.write(os.environ.get("OMNI_PATCHES_STATE_DIR", ""))
    ready.set()
    deadline = time.monotonic() + 60
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)


def plugin_only(ready, stop_file, env):
    """A worker whose shim stays off, reached only through vLLM's plugin entry point (what vLLM's
    ``load_general_plugins`` calls in every process it starts)."""
    os.environ.update(env)
    from omni_patches import plugin

    plugin.register()
    ready.set()
    deadline = time.monotonic() + 60
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)
