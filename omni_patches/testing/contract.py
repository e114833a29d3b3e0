"""The contract every patch passes -- the built-in ones (tests/test_contract.py) and an operator's overlay patch.

A patch's test author describes *where* its target lives (a :class:`~omni_patches.testing.Release`: the real
release files, stand-ins for the rest), in a module defining ``CASE``::

    LOADER = "vllm_omni/diffusion/lora/loader.py"
    base = Release("vllm-omni", "0.28.0", files=[LOADER], auto_standins=True).env()
    CASE = Case(
        patch_id="lora-accel-delta",
        affected=[base],
        skipped=[(Release("vllm-omni", "0.30.0", files=[LOADER], auto_standins=True).env(), "skipped:version",
                  "fixed upstream")],
        drifted=[(Env.edited("omni-0.28.0-renamed", base, LOADER, "def _prepare_lora_delta(",
                              "def _prepare_lora_delta_v2("), "no attribute")],
    )

and :func:`check` runs each part in an interpreter of its own (real upstream files and their stubs never leak
between cases; see :mod:`omni_patches.testing.zygote`): it applies on every affected version (target
imported before activation, and lazily after it), applies once (a second activation and a re-fired import
hook change nothing), unapplies to the identical original objects, skips outside its versions with the expected
reason, and reports drift -- never applying anything -- when its target changed shape.

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
compared by :func:`omni_patches.testing.child.fingerprint` -- tensors by dtype, shape and bytes -- or by
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

from omni_patches.tools import atomic
from omni_patches.testing import zygote


#: The ``OMNI_PATCHES*`` variables a child keeps when its switches are dropped: an overlay's registry, where records
#: go (a test session points it at its own directory), the log level -- settings, not switches.
KEPT_SETTINGS = ("OMNI_PATCHES_CONFIG", "OMNI_PATCHES_STATE_DIR", "OMNI_PATCHES_LOG_LEVEL")


def cache_dir() -> Path:
    """Where :meth:`Env.edited` keeps its edited copies: ``$OMNI_TEST_CACHE`` or ``~/.cache/omni-patches-tests``."""
    return Path(os.environ.get("OMNI_TEST_CACHE") or Path.home() / ".cache" / "omni-patches-tests")


#: Written into an edited copy's ``.complete`` marker; copies of an earlier layout (whole files, an empty marker)
#: can be told apart and removed by whoever cleans the cache.
EDITED_LAYOUT = "hard-linked 2"  # 1 copied the source's marker as a link and wrote through it


@dataclass
class Env:
    """A target version made importable: sys.path entries to prepend (built lazily) plus env vars."""

    label: str
    paths: Callable[[], list]
    env: dict = field(default_factory=dict)
    imports: list | None = None  # modules to import (default: the patch's targets that import here)
    #: ``() -> {"paths": [...], "modules": [...]}``: third-party modules of this environment's deps (directories
    #: among ``paths()``, never the release's own package) that a zygote may import once for all its children
    #: (:data:`omni_patches.testing.zygote.PRELOAD_ENV`); each child checks that its path holds the same files.
    preload: Callable[[], dict] | None = None

    @classmethod
    def edited(cls, label, base: "Env", relpath: str, old: str, new: str, **kw) -> "Env":
        """``base`` with one real file edited (``old`` -> ``new``): the upstream code drifted."""

        def build():
            src_paths = base.paths()
            src = Path(src_paths[0])
            key = hashlib.sha256(f"{src}|{relpath}|{old}|{new}".encode()).hexdigest()[:12]
            dst = cache_dir() / "edited" / f"{label}-{key}"

            def fill(tmp):
                # Hard links where the file system allows (a release tree is ~100 MB, the edit one file), so the
                # edited file is replaced, never written through its link into the release it came from; the
                # source's own ``.complete`` is left out (the copy's marker is written into a file of its own).
                shutil.copytree(src, tmp, symlinks=True, copy_function=atomic.link_or_copy, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", atomic.COMPLETE))
                target = Path(tmp) / relpath
                text = target.read_text()
                if old not in text:
                    raise AssertionError(f"{relpath}: {old!r} not found; the drift edit is stale")
                target.unlink()
                target.write_text(text.replace(old, new))

            # Under a lock, in a ``.part`` renamed into place: two processes asking for the same copy never see
            # half of one.
            atomic.build_once(dst, fill, cache=cache_dir() / "edited", key=dst.name, marker=EDITED_LAYOUT)
            return [str(dst), *src_paths[1:]]

        return cls(label, build, {**base.env, **kw.pop("env", {})}, kw.pop("imports", base.imports),
                   kw.pop("preload", base.preload))


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

    def env(self, kind: str, index: int) -> "Env":
        """The environment of one part (``kind`` as :func:`parts` names it)."""
        entry = {"affected": self.affected, "lazy": self.affected, "skipped": self.skipped, "drifted": self.drifted,
                 "source": self.source_built, "unexpected": self.unexpected}[kind][index]
        return entry.env if isinstance(entry, Unexpected) else entry if isinstance(entry, Env) else entry[0]

    def envs(self) -> list:
        """Every part's environment, in :func:`parts`' order of kinds."""
        return [*self.affected, *(e for e, *_ in self.skipped), *(e for e, _ in self.drifted),
                *(e for e, *_ in self.source_built), *(u.env for u in self.unexpected)]


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


KINDS = ("affected", "lazy", "skipped", "drifted", "source", "unexpected")


def parts(case: Case, lazy=None) -> list:
    """``(kind, index, label)`` of every part of ``case``'s contract. ``lazy``: the affected indexes also checked
    with the shim activated before the target's import (default: all of them)."""
    out = [("affected", i, env.label) for i, env in enumerate(case.affected)]
    out += [("lazy", i, case.affected[i].label) for i in (range(len(case.affected)) if lazy is None else lazy)]
    out += [("skipped", i, env.label) for i, (env, _, _) in enumerate(case.skipped)]
    out += [("drifted", i, env.label) for i, (env, _) in enumerate(case.drifted)]
    out += [("source", i, env.label) for i, (env, _, _) in enumerate(case.source_built)]
    out += [("unexpected", i, u.label) for i, u in enumerate(case.unexpected)]
    return out


def check(case_ref: str, kind: str, index: int, *, pythonpath=(), cwd=None, env=None, timeout: int = 600) -> dict:
    """Run one part of the contract of the case in module ``case_ref`` (its ``CASE``; importable with
    ``pythonpath``) in an interpreter of its own (forked from a zygote: :class:`Zygotes`). Returns its JSON
    report (``ok`` plus details); raises AssertionError
    with the child's output when a check fails. ``env``: the child's environment (default this one's without
    the ``OMNI_PATCHES*`` switches -- the child sets what each part needs -- keeping ``OMNI_PATCHES_CONFIG``,
    which names an overlay patch's registry)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES") or k in KEPT_SETTINGS}
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    preload = _preload_of(case_ref, kind, index)
    if preload:
        env[zygote.PRELOAD_ENV] = json.dumps(preload, sort_keys=True)
    argv = [case_ref, kind, str(index)]
    proc = _run_child(argv, env, cwd, timeout)
    rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    lines = [ln for ln in stdout.splitlines() if ln.startswith("CONTRACT ")]
    if rc != 0 or not lines:
        raise AssertionError(f"contract child failed (rc={rc})\n--- stdout\n{stdout[-6000:]}"
                             f"\n--- stderr\n{stderr[-6000:]}")
    return json.loads(lines[-1][len("CONTRACT "):])


def _preload_of(case_ref: str, kind: str, index: int):
    """The preload of the environment a check runs in, where this process has imported the case already (as a test
    that lists its parts has); None otherwise: the child then runs as it would without one."""
    case = getattr(sys.modules.get(case_ref), "CASE", None)
    if not isinstance(case, Case):
        return None
    try:
        env = case.env(kind, index)
    except (KeyError, IndexError):
        return None
    if not env.preload or any(k.startswith(Zygotes.EXTRA_PREFIXES) for k in env.env):
        return None  # the child sets what the preloaded modules read as they import: they import there
    return env.preload()


def run_code(code: str, *args, env=None, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` with ``env`` (default: this one's) in ``cwd``, as ``subprocess.run(...,
    capture_output=True, text=True)`` returns it; forked from a zygote (:class:`Zygotes`) unless ``env`` turns the
    shim on at start (its ``.pth`` acts before any code runs: only a fresh interpreter shows that) or the zygote
    is switched off. Raises ``subprocess.TimeoutExpired`` past ``timeout``."""
    return _run_child([str(a) for a in args], dict(os.environ if env is None else env), cwd, timeout, code=code)


def _run_child(argv, env, cwd, timeout, code=None) -> subprocess.CompletedProcess:
    """``python -m omni_patches.testing.child ARGV`` (``python -c CODE ARGV`` given ``code``): a fork of a zygote
    where one can run it, else a fresh interpreter of its own."""
    cmd = [sys.executable, *(["-c", code] if code is not None else ["-m", "omni_patches.testing.child"]), *argv]
    ran = zygotes.run(argv, env, cwd, timeout, code=code) if zygotes.wanted(env) else None
    if ran is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return subprocess.CompletedProcess(cmd, *ran)


#: ``0`` runs every check in an interpreter started for it alone (slower; the zygote is the default).
ZYGOTE_ENV = "OMNI_TESTING_ZYGOTE"


class Zygotes:
    """One :mod:`omni_patches.testing.zygote` per (start environment, working directory) this process runs children
    in: a child is a fork of a parent that imported torch once. The start environment is what the preload reads
    (:meth:`preload_env`); the rest, ``PYTHONPATH`` included, is each child's own, so children of every case share a
    zygote. Anything wrong with a zygote (it died, it cannot
    start) and the child runs in a fresh interpreter instead, as before."""

    def __init__(self):
        import atexit

        import threading

        self._procs = {}
        # One request at a time per client: a zygote answers on one pipe in order, so two threads sharing it could
        # each read the other's answer. A thread that finds it busy runs its child in a fresh interpreter instead.
        self._busy = threading.Lock()
        atexit.register(self.close)  # end of input: every zygote leaves with this process

    @staticmethod
    def wanted(env) -> bool:
        from omni_patches.flags import OFF_WORDS

        if env.get("OMNI_PATCHES", "").strip():
            return False  # the .pth would act in the zygote, before the fork: a fresh interpreter it is
        for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
            if any(os.path.exists(os.path.join(entry, f"{m}customize.py")) for m in ("site", "user")):
                return False  # imported at interpreter start, from the child's own path: only a fresh one does that
        value = env.get(ZYGOTE_ENV, os.environ.get(ZYGOTE_ENV, "1")).strip().lower()
        return not value or value not in OFF_WORDS  # unset or empty: the default, on

    #: What the interpreter and the preload (torch, numpy and their OpenMP / oneDNN runtimes) read as they start:
    #: a zygote is started with these alone and serves every child that agrees on them. Everything else -- a
    #: case's knobs, ``VLLM_*``, the shim's switches -- a child reads after the fork, from its own request, so
    #: children that differ only there share one zygote (keyed by the whole environment, nearly every case
    #: started its own, ~7 CPU-s each). ``PYTHONPATH`` is each child's own: it rebuilds ``sys.path`` from it.
    PRELOAD_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL", "ONEDNN", "DNNL", "OPENBLAS",
                        "NUMPY", "CUDA", "TRITON", "LD_", "LC_", "XDG_")
    PRELOAD_NAMES = frozenset({"HOME", "PATH", "TMPDIR", "TEMP", "TMP", "LANG", "LANGUAGE", "USER",
                               zygote.PRELOAD_ENV})
    #: Read at import by what an extra preload (:data:`zygote.PRELOAD_ENV`) imports (transformers, huggingface_hub):
    #: keyed too where one is asked for.
    EXTRA_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "PYDANTIC")
    CHILD_OWN = "PYTHONPATH"  # matches PRELOAD_PREFIXES, but is each child's own (not part of the key)
    #: pytest's name for the test that starts a zygote, passed on but never keyed: bench/suite_cpu.py charges the
    #: zygote's CPU to that test.
    TEST_NAME = "PYTEST_CURRENT_TEST"
    MAX = 3  # zygotes alive at once (each holds an interpreter with torch imported)
    #: Starts the zygote from this checkout's (or installation's) omni_patches, then leaves its path as an
    #: interpreter with no PYTHONPATH has it.
    BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); from omni_patches.testing import zygote; del sys.path[0];"
            " zygote.main()")

    @classmethod
    def preload_env(cls, env) -> dict:
        """The part of ``env`` a zygote is started with (and keyed by)."""
        prefixes = cls.PRELOAD_PREFIXES + (cls.EXTRA_PREFIXES if env.get(zygote.PRELOAD_ENV) else ())
        return {k: v for k, v in env.items()
                if k != cls.CHILD_OWN and (k in cls.PRELOAD_NAMES or k.startswith(prefixes))}

    def _get(self, env, cwd):
        start_env = self.preload_env(env)
        key = (tuple(sorted(start_env.items())), str(cwd or ""))
        proc = self._procs.pop(key, None)  # put back last: the dict is in order of use
        if proc is not None and proc.poll() is None:
            self._procs[key] = proc
        else:
            while len(self._procs) >= self.MAX:  # the least recently used goes
                self._stop(self._procs.pop(next(iter(self._procs))))
            home = str(Path(__file__).resolve().parents[2])
            boot_env = dict(start_env)
            if self.TEST_NAME in env:
                boot_env[self.TEST_NAME] = env[self.TEST_NAME]
            proc = self._procs[key] = subprocess.Popen(
                [sys.executable, "-c", self.BOOT, home], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=boot_env, cwd=cwd, text=True)
        return key, proc

    def run(self, argv, env, cwd, timeout, code=None):
        """``(returncode, stdout, stderr)`` of ``python -m omni_patches.testing.child ARGV`` (``python -c CODE
        ARGV`` given ``code``) run with ``env`` in ``cwd``, or None when no zygote could run it."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return self._run(argv, env, cwd, timeout, code)
        finally:
            self._busy.release()

    def _run(self, argv, env, cwd, timeout, code):
        import tempfile

        key, proc = self._get(env, cwd)
        fd_out, out = tempfile.mkstemp(prefix="omni-contract-", suffix=".out")
        fd_err, err = tempfile.mkstemp(prefix="omni-contract-", suffix=".err")
        os.close(fd_out)
        os.close(fd_err)
        try:
            try:
                request = {"argv": argv, "out": out, "err": err, "timeout": timeout, "env": dict(env),
                           "cwd": os.path.abspath(cwd) if cwd else None}
                if code is not None:
                    request["code"] = code
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                answer = proc.stdout.readline()
            except OSError:
                answer = ""
            if not answer:  # the zygote is gone: forget it; this check runs fresh
                self._procs.pop(key, None)
                proc.kill()
                proc.wait()
                return None
            answer = json.loads(answer)
            rc = answer["rc"]
            if answer.get("timed_out"):
                raise subprocess.TimeoutExpired(["-c" if code is not None else "omni_patches.testing.child", *argv],
                                                timeout)
            with open(out, errors="replace") as o, open(err, errors="replace") as e:
                return rc, o.read(), e.read()
        finally:
            for path in (out, err):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    @staticmethod
    def _stop(proc):
        try:
            proc.stdin.close()  # end of input: the zygote leaves
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - make sure it is gone
            proc.kill()

    def close(self):
        for proc in self._procs.values():
            self._stop(proc)
        self._procs.clear()


zygotes = Zygotes()
