"""Spawned child for tests/test_proof.py: activate the shim, import a fake target, wait to be told to exit."""
import importlib


def serve(ready, stop, target):
    import omni_patches

    omni_patches.activate()
    importlib.import_module(target)  # the fake patch applies here; proof records this process
    ready.set()
    stop.wait(60)
