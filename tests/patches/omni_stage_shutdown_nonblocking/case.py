"""Contract case for omni-stage-shutdown-nonblocking: the REAL stage_diffusion_client.py of each release, real pyzmq."""
from omni_patches.testing import Case, Env, Unexpected
from support.omni_cases import sandboxes, skipped, source_built
from support.stage_client_sandbox import CLIENT_RELPATH, paths


sandbox = sandboxes(paths)
BASE = sandbox("0.28.0")
SEND = 'self._request_socket.send(self._encoder.encode({"type": "shutdown"}))'


def _second_shutdown():
    """shutdown() on a client already shut down (sockets and context closed): stock's send fails on the closed
    socket, its ``except`` swallows that, and it returns."""
    from patches.omni_stage_send_dead_engine.case import closed_client

    return closed_client().shutdown()


CASE = Case(
    patch_id="omni-stage-shutdown-nonblocking",
    affected=[sandbox("0.24.0rc1"), BASE, sandbox("0.30.0")],
    skipped=skipped(
        sandbox, "0.28.0", "OMNI_PATCHES_OMNI_STAGE_SHUTDOWN_NONBLOCKING",
        # Upstream's fix found by feature although the version says 0.28.0 (a vendor backport).
        backport=(CLIENT_RELPATH, SEND,
                  'self._request_socket.send(self._encoder.encode({"type": "shutdown"}), flags=zmq.NOBLOCK)'),
        # 0.23.0rc1 connect()s the request socket: its send queues and never blocks.
        outside="0.23.0rc1"),
    source_built=source_built(sandbox, "0.28.0", "0.28.1.dev3+g9f8e7d6c", fixed="0.32.0rc1"),
    drifted=[
        (Env.edited("omni-0.28.0-renamed", BASE, CLIENT_RELPATH, "    def shutdown(self) -> None:",
                    "    def close(self) -> None:"), "no attribute 'shutdown'"),
        (Env.edited("omni-0.28.0-helper-send", BASE, CLIENT_RELPATH, SEND,
                    'self._send_request(self._encoder.encode({"type": "shutdown"}))'),
         "no longer sends on self._request_socket"),
    ],
    unexpected=[Unexpected(BASE, _second_shutdown, note="the client has no open zmq request socket")],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-omni==0.22.0": "skip: out of range", "vllm-omni==0.24.0": "would apply",
    "vllm-omni==0.28.0": "would apply", "vllm-omni==0.30.0": "would apply",
    "vllm-omni==0.32.0rc1": "skip: fixed upstream",
}
