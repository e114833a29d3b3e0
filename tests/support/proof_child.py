"""Spawned child for tests/test_proof.py: activate the shim, import a fake target, wait to be told to exit.

"Exit" is a file, not a multiprocessing.Event: a sibling killed with SIGKILL while sleeping in Event.wait()
never acknowledges Event.set(), which would then block the parent forever.
"""
import importlib
import os
import time


def serve(ready, stop_file, target):
    import omni_patches

    omni_patches.activate()
    importlib.import_module(target)  # the fake patch applies here; proof records this process
    ready.set()
    deadline = time.monotonic() + 60
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)
