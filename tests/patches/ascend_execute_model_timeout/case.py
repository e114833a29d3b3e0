"""Contract case for ascend-execute-model-timeout: REAL vllm-ascend platform.py + REAL vLLM envs.py per release.

The patch changes ``os.environ`` (for child processes) and sets the variable on ``vllm.envs`` (this process, as
upstream does): ``vllm.envs`` is imported with the target so the contract's snapshot sees that change and its
exact undo.

Affected: one release of every minor line in the range, oldest (0.9.2rc1) to newest (0.26.0rc1); every affected
release is covered by test_execute_model_timeout.py (``ascend_timeout_sandbox.AFFECTED``).
"""
import os

from patches.ascend_execute_model_timeout.ascend_timeout_sandbox import platform_dir
from omni_patches.testing import Case, Env, Unexpected

NAME = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
IMPORTS = ["vllm_ascend.platform", "vllm.envs"]


def _paths(version, **kw):
    def paths():
        # Runs in the contract's child: a developer's own VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS would make the patch
        # keep it and change nothing. (An Env's own ``env`` is applied after this.)
        os.environ.pop(NAME, None)
        return [str(platform_dir(version, **kw))]

    return paths


def _env(version, env=None, **kw):
    label = f"ascend-{version}"
    if kw.get("vllm_version"):
        label += f"-vllm-{kw['vllm_version']}"
    if kw.get("metadata_version"):
        label += f"-as-{kw['metadata_version']}"
    return Env(label, _paths(version, **kw), env=dict(env or {}), imports=IMPORTS)


def _vllm_reads():
    """The timeout vLLM's MultiprocExecutor passes to execute_model: ``envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``."""
    import vllm.envs as envs

    return getattr(envs, NAME)


V026 = _env("0.26.0rc1")
ONE_PER_MINOR = ["0.9.2rc1", "0.10.2rc1", "0.11.0", "0.12.0rc1", "0.13.0", "0.14.0rc1", "0.15.0rc1", "0.16.0rc1",
                 "0.17.0rc1", "0.18.0rc1", "0.19.1rc1", "0.20.2rc1", "0.21.0rc1", "0.22.1rc1", "0.23.0rc1",
                 "0.24.0rc1", "0.25.1rc1"]

CASE = Case(
    patch_id="ascend-execute-model-timeout",
    affected=[*(_env(v) for v in ONE_PER_MINOR), V026],
    skipped=[
        (_env("0.23.0.post1"), "skipped:version", "already raises VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
        (_env("0.30.0rc2"), "skipped:version", "fixed upstream in vllm-ascend 0.27.1rc1"),
        # below the range: vLLM 0.9.1 hard-codes its timeout (no variable to set)
        (_env("0.9.1"), "skipped:version", "outside"),
        (Env.edited("vllm-default-raised", V026, "vllm/envs.py",
                    'os.getenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300")',
                    'os.getenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")'), "skipped:version",
         "vLLM's own default"),
    ],
    source_built=[
        (_env("0.26.0rc1", metadata_version="0.19.1rc2.dev1637+g182b75ea8"), "applied", "decided by code features"),
        (_env("0.24.0rc1", metadata_version="0.0.0"), "applied", "is a source build without tags"),
        (_env("0.30.0rc2", metadata_version="0.0.0"), "skipped:version", "already raises"),
    ],
    drifted=[
        (Env.edited("vllm-renamed-variable", V026, "vllm/envs.py",
                    '"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": lambda', '"VLLM_EXECUTE_MODEL_TIMEOUT_S": lambda'),
         "does not define VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
        # real files, mismatched pair: the oldest release in range on the vLLM before it (no such variable)
        (_env("0.9.2rc1", vllm_version="0.9.1"), "does not define VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
    ],
    # A value the user set is an input the patch was not built to change: vLLM reads exactly what stock reads
    # (the same ValueError for a non-integer), the patch keeps it and says why.
    unexpected=[
        Unexpected(_env("0.26.0rc1", env={NAME: "abc"}), _vllm_reads, note="kept, not an integer"),
        Unexpected(_env("0.9.2rc1", env={NAME: "600"}), _vllm_reads, note="kept, below the HCCL operator timeout"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here; the words are omni_patches.tools.audit's).
VERDICTS = {
    "vllm-ascend==0.9.1": "skip: out of range", "vllm-ascend==0.9.2rc1": "would apply",
    "vllm-ascend==0.18.0rc1": "would apply", "vllm-ascend==0.22.1rc1": "would apply",
    "vllm-ascend==0.23.0rc1": "would apply", "vllm-ascend==0.23.0.post1": "skip: fixed upstream",
    "vllm-ascend==0.24.0rc1": "would apply", "vllm-ascend==0.26.0rc1": "would apply",
    "vllm-ascend==0.27.1rc1": "skip: fixed upstream", "vllm-ascend==0.30.0rc2": "skip: fixed upstream",
}
