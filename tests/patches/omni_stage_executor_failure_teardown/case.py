"""Contract case for omni-stage-executor-failure-teardown: the REAL stage_diffusion_proc.py of each release.

Affected: every release from 0.22.0 (the first whose run_loop tears down on a fatal engine failure) to 0.30.0.
"""
from omni_patches.testing import Case, Env, Unexpected
from patches.omni_stage_executor_failure_teardown.executor_failure_child import PROC_RELPATH, paths
from support.omni_cases import sandboxes, skipped, source_built

AFFECTED = ["0.22.0", "0.23.0rc1", "0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0", "0.27.0rc1",
            "0.28.0rc1", "0.28.0", "0.29.0rc1", "0.30.0rc1", "0.30.0"]


sandbox = sandboxes(paths)
BASE = sandbox("0.30.0")


def _executor_without_callbacks():
    """run_loop of a process whose engine's executor has no register_failure_callback: it serves until the
    client sends "shutdown" (pickle: the sandbox's codec) and returns None."""
    import asyncio
    import pickle
    import shutil
    import tempfile
    import threading
    import types

    import zmq
    from vllm_omni.diffusion.stage_diffusion_proc import StageDiffusionProc

    tmp = tempfile.mkdtemp(prefix="omni-case-")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp}/req")
    pull.bind(f"ipc://{tmp}/resp")
    sender = threading.Thread(target=push.send, args=(pickle.dumps({"type": "shutdown"}),))  # waits for run_loop
    sender.start()
    proc = StageDiffusionProc.__new__(StageDiffusionProc)
    proc.__dict__.update(_model="m", _od_config=types.SimpleNamespace(streaming_output=False),
                         _engine=types.SimpleNamespace(executor=object()), _executor=None, _closed=False,
                         _active_tasks=None, _fatal_event=None)
    try:
        return asyncio.run(proc.run_loop(f"ipc://{tmp}/req", f"ipc://{tmp}/resp"))
    finally:
        sender.join(10)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


CASE = Case(
    patch_id="omni-stage-executor-failure-teardown",
    affected=[sandbox(v) for v in AFFECTED],
    skipped=skipped(
        sandbox, "0.30.0", "OMNI_PATCHES_OMNI_STAGE_EXECUTOR_FAILURE_TEARDOWN",
        # Upstream's fix found by feature although the version says 0.30.0 (a vendor backport).
        backport=(PROC_RELPATH, "    def _signal_fatal_engine_failure(",
                  "    def _watch_executor_failure(self, loop):\n        pass\n\n"
                  "    def _signal_fatal_engine_failure("),
        # 0.21.0rc1's run_loop has no fatal-failure teardown to signal.
        outside="0.21.0rc1"),
    source_built=source_built(sandbox, "0.30.0", "0.30.1.dev4+g1a2b3c4d", fixed="0.31.0rc1"),
    drifted=[
        (Env.edited("omni-0.30.0-renamed", BASE, PROC_RELPATH, "    def _signal_fatal_engine_failure(",
                    "    def _signal_fatal_failure("), "no attribute '_signal_fatal_engine_failure'"),
        (Env.edited("omni-0.30.0-run-loop-renamed", BASE, PROC_RELPATH, "    async def run_loop(",
                    "    async def serve("), "no attribute 'run_loop'"),
    ],
    unexpected=[Unexpected(BASE, _executor_without_callbacks, note="the engine's executor takes no failure callback")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "would apply", "vllm-omni==0.24.0": "would apply", "vllm-omni==0.30.0": "would apply",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream", "vllm-omni==0.31.0rc1": "skip: fixed upstream",
    "vllm-omni==0.20.0": "skip: out of range",
}
