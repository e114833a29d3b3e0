"""Contract case for omni-stage-send-dead-engine: the REAL stage_diffusion_client.py of each release, real pyzmq.

Affected: every release from 0.24.0rc1 (the first that binds the request socket) to 0.30.0, the last before the fix.
"""
from omni_patches.testing import Case, Env, Unexpected
from support.omni_cases import sandboxes, skipped, source_built
from support.stage_client_sandbox import CLIENT_RELPATH, paths

AFFECTED = ["0.24.0rc1", "0.24.0", "0.25.0rc1", "0.26.0rc1", "0.26.0", "0.27.0rc1", "0.28.0rc1", "0.28.0",
            "0.29.0rc1", "0.30.0rc1", "0.30.0"]


sandbox = sandboxes(paths)
BASE = sandbox("0.28.0")
ABORT_SEND = ('                    "type": "abort",\n                    "request_ids": list(request_ids),\n'
              '                }\n            )\n        )')
ADD_SEND = ('        self._request_socket.send(\n            self._encoder.encode(\n                {\n'
            '                    "type": "add_request",')


def closed_client():
    """A real client whose sockets and context are already closed (an evicted, shut-down replica)."""
    import shutil
    import tempfile

    from support.stage_peer import metadata
    from vllm_omni.diffusion.stage_diffusion_client import StageDiffusionClient

    tmp = tempfile.mkdtemp(prefix="omni-case-")
    client = StageDiffusionClient.from_addresses(metadata(), request_address=f"ipc://{tmp}/req",
                                                 response_address=f"ipc://{tmp}/resp", proc_manager=None)
    client._request_socket.close(linger=0)
    client._response_socket.close(linger=0)
    client._zmq_ctx.term()
    shutil.rmtree(tmp, ignore_errors=True)  # the sockets are closed: nothing lives there any more
    return client


def _abort_on_a_closed_client():
    """The orchestrator aborting requests on a replica it already shut down: stock's send raises ZMQError."""
    import asyncio

    return asyncio.run(closed_client().abort_requests_async(["req-1"]))


CASE = Case(
    patch_id="omni-stage-send-dead-engine",
    affected=[sandbox(v) for v in AFFECTED],
    skipped=skipped(
        sandbox, "0.28.0", "OMNI_PATCHES_OMNI_STAGE_SEND_DEAD_ENGINE",
        # Upstream's fix found by feature although the version says 0.28.0 (a vendor backport of the abort send).
        backport=(CLIENT_RELPATH, ABORT_SEND,
                  ABORT_SEND.replace("            )\n        )", "            ),\n            flags=zmq.NOBLOCK,\n        )")),
        # 0.23.0rc1 connect()s the request socket: its sends queue and never block.
        outside="0.23.0rc1"),
    source_built=source_built(sandbox, "0.28.0", "0.28.1.dev3+g9f8e7d6c", fixed="0.31.0rc1"),
    drifted=[
        (Env.edited("omni-0.28.0-renamed", BASE, CLIENT_RELPATH, "    async def abort_requests_async(",
                    "    async def abort_async("), "no attribute 'abort_requests_async'"),
        (Env.edited("omni-0.28.0-helper-send", BASE, CLIENT_RELPATH, ADD_SEND,
                    ADD_SEND.replace("self._request_socket.send(", "self._emit(")),
         "add_request_async no longer sends on self._request_socket"),
        (Env.edited("omni-0.28.0-sync-abort", BASE, CLIENT_RELPATH, "    async def abort_requests_async(",
                    "    def abort_requests_async("), "abort_requests_async is no longer a coroutine function"),
    ],
    unexpected=[Unexpected(BASE, _abort_on_a_closed_client, note="the client has no open zmq request socket")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "skip: out of range", "vllm-omni==0.24.0": "would apply",
    "vllm-omni==0.28.0": "would apply", "vllm-omni==0.30.0": "would apply",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream", "vllm-omni==0.23.0rc1": "skip: out of range",
    "vllm-omni==0.24.0rc1": "would apply", "vllm-omni==0.31.0rc1": "skip: fixed upstream",
}
