"""The test-suite's side of the contract harness (:mod:`omni_patches.testing`, where the checks are described):
the built-in cases (``tests/patches/<module>/case.py``) import from ``tests/`` and run with the session's
environment."""
from pathlib import Path

from omni_patches.testing import check

from .venvs import without_switches

TESTS = Path(__file__).resolve().parents[1]


def run_child(case_ref: str, kind: str, index: int, timeout: int = 600) -> dict:
    """One part of the contract of the case module ``case_ref`` (importable from ``tests/``), in a fresh
    interpreter; returns its report."""
    return check(case_ref, kind, index, pythonpath=[TESTS, TESTS.parent], cwd=TESTS, env=without_switches(),
                 timeout=timeout)


def case_modules() -> dict:
    """``{folder name: module}`` of every ``tests/patches/<module>/case.py`` (a folder needs no ``__init__.py``:
    a new patch is its module, its case and one test)."""
    import importlib

    return {case.parent.name: importlib.import_module(f"patches.{case.parent.name}.case")
            for case in sorted((TESTS / "patches").glob("*/case.py"))}
