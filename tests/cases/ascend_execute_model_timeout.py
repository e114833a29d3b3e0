"""Contract case for ascend-execute-model-timeout: REAL vllm-ascend platform.py + REAL vLLM envs.py per release.

The patch changes ``os.environ`` (for child processes) and sets the variable on ``vllm.envs`` (this process, as
upstream does): ``vllm.envs`` is imported with the target so the contract's snapshot sees that change and its
exact undo.
"""
import os

from support.ascend_timeout_sandbox import platform_dir
from support.contract import Case, Env

NAME = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
IMPORTS = ["vllm_ascend.platform", "vllm.envs"]


def _paths(version, **kw):
    def paths():
        # Runs in the contract's child: a developer's own VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS would make the patch
        # keep it and change nothing.
        os.environ.pop(NAME, None)
        return [str(platform_dir(version, **kw))]

    return paths


def _env(version, **kw):
    meta = kw.get("metadata_version")
    return Env(f"ascend-{version}" + (f"-as-{meta}" if meta else ""), _paths(version, **kw), imports=IMPORTS)


V026 = _env("0.26.0rc1")

CASE = Case(
    patch_id="ascend-execute-model-timeout",
    affected=[_env("0.24.0rc1"), _env("0.25.1rc1"), V026],
    skipped=[
        (_env("0.23.0.post1"), "skipped:version", "already raises VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
        (_env("0.30.0rc2"), "skipped:version", "fixed upstream in vllm-ascend 0.27.1rc1"),
        (_env("0.18.0", metadata_version="0.17.0rc1"), "skipped:version", "outside"),
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
         "no longer defines VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
    ],
)
