"""Contract case for omni-stage-shutdown-nonblocking: the REAL stage_diffusion_client.py of each release, real pyzmq."""
from support.contract import Case, Env
from support.stage_client_sandbox import CLIENT_RELPATH, paths


def sandbox(version, **kw):
    return Env(f"omni-{version}", lambda: paths(version), **kw)


BASE = sandbox("0.28.0")
SEND = 'self._request_socket.send(self._encoder.encode({"type": "shutdown"}))'

CASE = Case(
    patch_id="omni-stage-shutdown-nonblocking",
    affected=[sandbox("0.24.0rc1"), BASE, sandbox("0.30.0")],
    skipped=[
        (sandbox("0.31.0rc1"), "skipped:version", "fixed upstream"),
        (sandbox("0.32.0rc1"), "skipped:version", "fixed upstream"),
        # Upstream's fix found by feature although the version says 0.28.0 (a vendor backport).
        (Env.edited("omni-0.28.0-backported", BASE, CLIENT_RELPATH, SEND,
                    'self._request_socket.send(self._encoder.encode({"type": "shutdown"}), flags=zmq.NOBLOCK)'),
         "skipped:version", "fixed upstream"),
        (sandbox("0.28.0", env={"OMNI_PATCHES_OMNI_STAGE_SHUTDOWN_NONBLOCKING": "0"}), "skipped:disabled",
         "NONBLOCKING=0"),
        # 0.23.0rc1 connect()s the request socket: its send queues and never blocks.
        (sandbox("0.23.0rc1"), "skipped:version", "outside"),
    ],
    source_built=[
        (Env.source_build(BASE, "vllm_omni-0.28.0.dist-info/METADATA", "0.28.0", "0.28.1.dev3+g9f8e7d6c"), "applied",
         "decided by code features"),
        (Env.source_build(sandbox("0.32.0rc1"), "vllm_omni-0.32.0rc1.dist-info/METADATA", "0.32.0rc1", "0.0.0"),
         "skipped:version", "fixed upstream"),
    ],
    drifted=[
        (Env.edited("omni-0.28.0-renamed", BASE, CLIENT_RELPATH, "    def shutdown(self) -> None:",
                    "    def close(self) -> None:"), "no attribute 'shutdown'"),
        (Env.edited("omni-0.28.0-helper-send", BASE, CLIENT_RELPATH, SEND,
                    'self._send_request(self._encoder.encode({"type": "shutdown"}))'),
         "no longer sends on self._request_socket"),
    ],
)
