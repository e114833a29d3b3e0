"""The shared contract every real patch passes (tests/test_contract.py runs it).

A patch's test author describes *where* its target lives, in ``tests/patches/<patch module>/case.py``::

    CASE = Case(
        patch_id="lora-accel-delta",
        affected=[Env("omni-0.28.0", lambda: [str(loader_sandbox("0.28.0"))])],
        skipped=[(Env("omni-0.30.0", ...), "skipped:version", "fixed upstream")],
        drifted=[(Env.edited("omni-0.28.0-renamed", base, "vllm_omni/diffusion/lora/loader.py",
                              "def _prepare_lora_delta(", "def _prepare_lora_delta_v2("), "no attribute")],
    )

and the contract checks, each in a fresh interpreter (real upstream files and their stubs never leak
between cases): it applies on every affected version (target imported before activation, and lazily
after it), applies once (a second activation and a re-fired import hook change nothing), unapplies to
the identical original objects, skips outside its versions with the expected reason, and reports drift
-- never applying anything -- when its target changed shape.

**Patches never break the call they wrap.** A wrapper that meets an input it was not built for runs the
original code and says so once (``ctx.fallback("why")`` / ``ctx.stock("why", wrapped, args, kwargs)``, see
omni_patches/context.py); it never raises where stock would not. Every case declares at least one such
input in ``unexpected``::

    def _drive_vllm_param():   # module level in the case file; runs in the contract child
        from vllm_omni.diffusion.lora import loader
        ...build fresh inputs the wrapper was not built for, call the wrapped function through its
        module (so the patched object is the one called), return what it returned (tensors are fine)...

    unexpected=[Unexpected(Env("omni-0.28.0", ...), _drive_vllm_param, note="not a plain tensor")]

The child imports the targets, runs ``drive()`` unpatched (stock), activates the shim (the patch must be
``applied``), runs it twice more patched, and checks: the same outcome as stock (the same return value,
compared by :func:`support.contract_child.fingerprint` -- tensors by dtype, shape and bytes -- or by
``same(stock, patched)``; or the same exception type and message), and ``note`` in the patch's ``status``
reason, exactly once. ``drive`` must build fresh inputs on every call (it runs three times).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import wheels
from .venvs import without_switches

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Env:
    """A target version made importable: sys.path entries to prepend (built lazily) plus env vars."""

    label: str
    paths: Callable[[], list]
    env: dict = field(default_factory=dict)
    imports: list | None = None  # modules to import (default: the patch's targets that import here)

    @classmethod
    def edited(cls, label, base: "Env", relpath: str, old: str, new: str, **kw) -> "Env":
        """``base`` with one real file edited (``old`` -> ``new``): the upstream code drifted."""

        def build():
            src_paths = base.paths()
            src = Path(src_paths[0])
            key = hashlib.sha256(f"{src}|{relpath}|{old}|{new}".encode()).hexdigest()[:12]
            dst = wheels.CACHE / "edited" / f"{label}-{key}"
            if not (dst / ".complete").exists():
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst, symlinks=True)
                target = dst / relpath
                text = target.read_text()
                if old not in text:
                    raise AssertionError(f"{relpath}: {old!r} not found; the drift edit is stale")
                target.write_text(text.replace(old, new))
                (dst / ".complete").touch()
            return [str(dst), *src_paths[1:]]

        return cls(label, build, {**base.env, **kw.pop("env", {})}, kw.pop("imports", base.imports))


    @classmethod
    def source_build(cls, base: "Env", metadata: str, version: str, new: str, **kw) -> "Env":
        """``base`` installed the way a source checkout is: the same files, its metadata saying ``new``
        (setuptools_scm: ``0.19.1rc2.dev1637+g182b75ea8``, or ``0.0.0`` without tags)."""
        return cls.edited(f"{base.label}-as-{new}", base, metadata, f"\nVersion: {version}\n", f"\nVersion: {new}\n",
                          **kw)


@dataclass
class Case:
    patch_id: str
    affected: list
    skipped: list = field(default_factory=list)  # (Env, expected state, reason substring)
    drifted: list = field(default_factory=list)  # (Env, reason substring)
    # (Env, expected state, reason substring): the files of a release installed as a source build. The gate
    # ignores such versions (see omni_patches.versions.source_build): the patch's feature checks decide.
    source_built: list = field(default_factory=list)
    # Unexpected(...) inputs: the wrapper runs the original code, gives stock's outcome, notes it once.
    unexpected: list = field(default_factory=list)


@dataclass
class Unexpected:
    """An input a patch's wrapper was not built for (see the module docstring)."""

    env: Env
    drive: Callable[[], object]  # module-level function of the case file: fresh inputs, calls the wrapped code
    note: str  # substring the patched run's status reason must show once (from ctx.fallback)
    same: Callable | None = None  # (stock result, patched result) -> bool; default: equal fingerprints

    @property
    def label(self):
        return f"{self.env.label}-{getattr(self.drive, '__name__', 'drive').lstrip('_')}"


def run_child(case_module: str, kind: str, index: int, timeout: int = 600) -> dict:
    """Run one contract check in a fresh interpreter; returns its JSON report (``ok`` plus details)."""
    env = without_switches()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "support.contract_child", case_module, kind, str(index)],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=str(ROOT / "tests"),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CONTRACT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"contract child failed (rc={proc.returncode})\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("CONTRACT "):])
