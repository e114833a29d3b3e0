"""lora-accel-delta and lora-cpu-fused-delta on the REAL vllm-omni loader.py (sandbox, tests/support/omni_loader.py).

Each scenario runs DRIVER in a fresh interpreter: the real loader of one release, the shim activated with
OMNI_PATCHES=1 (switches per scenario), optionally the simulated ``npu`` (tests/support/fake_npu.py, installed
after the loader import as it must be), a small transformer-like module with a stacked ``to_qkv`` (+bias),
a plain projection and a bias, and a LoRA that covers every one of them. The driver loads, then unloads,
and reports what ran where (npu counters, CPU aten ops seen by a TorchDispatchMode) and how far the
weights are from a float64 reference.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support.omni_loader import run_sandboxed
from support.venvs import without_switches

ROOT = Path(__file__).resolve().parents[1]

DRIVER = r'''
import json, os, sys
import torch
import omni_patches

cfg = json.loads(os.environ["LORA_TEST_CFG"])
omni_patches.activate()
import vllm_omni.diffusion.lora.loader as L
import vllm_omni.diffusion.distributed.utils as U
from tests.support import fake_npu
from tests.support.omni_loader import expected_deltas, make_lora_state_dict, tiny_transformer
from torch.utils._python_dispatch import TorchDispatchMode

if cfg.get("npu"):
    fake_npu.install()

H, R = cfg.get("hidden", 32), cfg.get("rank", 4)
dtype = getattr(torch, cfg.get("dtype", "float32"))


torch.manual_seed(0)
model = tiny_transformer(H).to(dtype)
if cfg.get("npu_param"):
    model.blocks[1].to_out.to("npu:0")  # an accelerator-resident layer
sd = make_lora_state_dict(model, rank=R, bias=True, seed=1)
pairs = sum(k.endswith(".lora_A.weight") for k in sd)
npu_pairs = sum(k.endswith(".lora_A.weight") and "blocks.1.to_out" in k for k in sd) if cfg.get("npu_param") else 0
ref = expected_deltas(sd, model)
before = {k: v.detach().cpu().double() for k, v in model.named_parameters("transformer")}


class CpuOps(TorchDispatchMode):
    """Counts aten ops that run on CPU tensors (the fake npu's own kernels see npu tensors)."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(a, torch.Tensor)]
        if flat and all(t.device.type == "cpu" for t in flat):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def errors(expect_delta_sign):
    """Per-parameter max |param - (before + sign*ref)| and the dtype tolerance for it."""
    out = {}
    eps = torch.finfo(dtype).eps
    for k, v in model.named_parameters("transformer"):
        want = before[k] + expect_delta_sign * ref[k] if k in ref else before[k]
        err = (v.detach().cpu().double() - want).abs().max().item()
        tol = 2 * eps * (before[k].abs().max().item() + (ref[k].abs().max().item() if k in ref else 0))
        out[k] = (err, tol)
    return out


def run(fn):
    if cfg.get("npu"):
        fake_npu.reset_counters()
    U.CALLS = 0
    mode = CpuOps()
    with mode:
        keys = fn(sd, model)
    return {"keys": len(keys), "calls": U.CALLS, "cpu_ops": mode.ops,
            "npu": fake_npu.counters() if cfg.get("npu") else None}


res = {"status": {s.id: [s.state, s.reason] for s in omni_patches.status()}, "pairs": pairs,
       "npu_pairs": npu_pairs, "n_keys": len(sd)}
res["load"] = run(L.LoraLoaderMixin.load_lora_into_module)
res["load"]["errors"] = errors(1)
res["unload"] = run(L.LoraLoaderMixin.unload_module_lora)
res["unload"]["errors"] = errors(0)
if cfg.get("stock_compare"):
    # The same load with every patch undone: stock's error against the same float64 reference.
    def sq_err():
        num = n = 0.0
        mx = 0.0
        for k, v in model.named_parameters("transformer"):
            if k in ref:
                d = v.detach().double() - (before[k] + ref[k])
                num += d.pow(2).sum().item(); n += d.numel(); mx = max(mx, d.abs().max().item())
        return (num / n) ** 0.5, mx

    with torch.no_grad():
        for k, v in model.named_parameters("transformer"):
            v.copy_(before[k].to(v.dtype))
    L.LoraLoaderMixin.load_lora_into_module(sd, model)
    res["patched_err"] = sq_err()
    omni_patches.unapply_all()
    with torch.no_grad():
        for k, v in model.named_parameters("transformer"):
            v.copy_(before[k].to(v.dtype))
    L.LoraLoaderMixin.load_lora_into_module(sd, model)
    res["stock_err"] = sq_err()
print("RESULT " + json.dumps(res))
'''

FUSED_ON = {"OMNI_PATCHES_LORA_CPU_FUSED_DELTA": "1"}
ACCEL_OFF = {"OMNI_PATCHES_LORA_ACCEL_DELTA": "0"}


def drive(version, *, env=None, local_device=None, broken=False, **cfg):
    extra = {"OMNI_PATCHES": "1", "LORA_TEST_CFG": json.dumps(cfg), **(env or {})}
    proc = run_sandboxed(version, DRIVER, extra=extra, local_device=local_device, fake_npu_broken=broken)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def assert_weights_right(res):
    for phase in ("load", "unload"):
        bad = {k: e for k, e in res[phase]["errors"].items() if e[0] > e[1]}
        assert not bad, f"{phase}: weights off the float64 reference beyond dtype tolerance: {bad}"
        assert res[phase]["keys"] == res["n_keys"], f"{phase}: not every LoRA key was used"


# ------------------------------------------------------------------------------ lora-accel-delta

@pytest.mark.parametrize("version", ["0.27.0rc1", "0.28.0", "0.29.0rc1"])
def test_accel_computes_cpu_weight_deltas_on_the_device(version):
    res = drive(version, local_device="npu:0", npu=True)
    assert res["status"]["lora-accel-delta"][0] == "applied", res["status"]
    for phase in ("load", "unload"):
        r = res[phase]
        # Every B @ A of a CPU-resident weight ran on the accelerator: none on CPU.
        assert r["npu"]["npu_matmuls"] == res["pairs"], (phase, r)
        assert r["cpu_ops"].get("mm", 0) == 0, (phase, r["cpu_ops"])
        assert r["calls"] == 1, f"{phase}: get_local_device() called {r['calls']} times, want once per call"
    assert_weights_right(res)


def test_accel_off_is_stock_behaviour():
    # The negative control for the test above: same machine, patch switched off -> everything on CPU.
    res = drive("0.28.0", env=ACCEL_OFF, local_device="npu:0", npu=True)
    assert res["status"]["lora-accel-delta"][0] == "skipped:disabled"
    for phase in ("load", "unload"):
        assert res[phase]["npu"]["npu_matmuls"] == 0
        assert res[phase]["npu"]["h2d_copies"] == 0
        assert res[phase]["cpu_ops"].get("mm", 0) == res["pairs"]
    assert_weights_right(res)


def test_accel_broken_probe_falls_back_to_cpu_without_copies():
    res = drive("0.28.0", local_device="npu:0", broken=True, npu=True)
    assert res["status"]["lora-accel-delta"][0] == "applied"
    for phase in ("load", "unload"):
        n = res[phase]["npu"]
        assert n["npu_matmuls"] == 0 and n["h2d_copies"] == 0 and n["h2d_bytes"] == 0, (phase, n)
        assert n["npu_alloc_failures"] == 1, f"{phase}: probe tried {n['npu_alloc_failures']} times, want once"
        assert res[phase]["calls"] == 1
    assert_weights_right(res)


def test_accel_resident_params_use_their_own_device():
    # No local accelerator (get_local_device() -> cpu); one layer already lives on the npu. Stock 0.28
    # would compute its delta on CPU and copy it over; with the patch it is computed where the weight is.
    res = drive("0.28.0", local_device="cpu", npu=True, npu_param=True)
    assert res["npu_pairs"] == 1
    for phase in ("load", "unload"):
        assert res[phase]["npu"]["npu_matmuls"] == res["npu_pairs"], res[phase]["npu"]
        assert res[phase]["cpu_ops"].get("mm", 0) == res["pairs"] - res["npu_pairs"]
    assert_weights_right(res)


def test_accel_without_any_accelerator_changes_nothing():
    res = drive("0.28.0", local_device="cpu")
    for phase in ("load", "unload"):
        assert res[phase]["cpu_ops"].get("mm", 0) == res["pairs"]
        assert res[phase]["calls"] == 1
    assert_weights_right(res)


# ------------------------------------------------------------------------------ lora-cpu-fused-delta

@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_fused_accumulates_in_place_without_a_temporary_delta(version):
    res = drive(version, env=FUSED_ON, local_device="cpu")
    assert res["status"]["lora-cpu-fused-delta"][0] == "applied", res["status"]
    shards = res["pairs"]  # one addmm_ per (shard of a) weight
    for phase in ("load", "unload"):
        ops = res[phase]["cpu_ops"]
        assert ops.get("addmm_", 0) == shards, (phase, ops)
        # No B @ A materialised, no concatenated stacked delta (weights or biases), no add of a weight delta.
        assert ops.get("mm", 0) == 0 and ops.get("cat", 0) == 0, (phase, ops)
        biases = 2 * (3 + 1)  # per block: 3 qkv bias shards + to_out.bias
        assert ops.get("add_", 0) + ops.get("sub_", 0) == biases, (phase, ops)
    assert_weights_right(res)


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_fused_error_is_no_larger_than_stock_on_bf16(version):
    res = drive(version, env=FUSED_ON, local_device="cpu", dtype="bfloat16", hidden=256, rank=16,
                stock_compare=True)
    (p_rms, p_max), (s_rms, s_max) = res["patched_err"], res["stock_err"]
    assert p_rms <= s_rms and p_max <= s_max, f"fused rms/max {p_rms:.3g}/{p_max:.3g} vs stock {s_rms:.3g}/{s_max:.3g}"
    assert p_rms < s_rms, "identical errors: the fused path did not run"
    assert_weights_right(res)


def test_fused_composes_with_accel_on_028():
    # Accelerator usable: lora-accel-delta owns the CPU weights' deltas, nothing is fused on CPU.
    res = drive("0.28.0", env=FUSED_ON, local_device="npu:0", npu=True)
    assert {res["status"][p][0] for p in ("lora-accel-delta", "lora-cpu-fused-delta")} == {"applied"}
    for phase in ("load", "unload"):
        assert res[phase]["npu"]["npu_matmuls"] == res["pairs"]
        assert res[phase]["cpu_ops"].get("addmm_", 0) == 0
    assert_weights_right(res)
    # Probe fails: the CPU fallback is the fused one, and nothing touches the device.
    res = drive("0.28.0", env=FUSED_ON, local_device="npu:0", broken=True, npu=True)
    for phase in ("load", "unload"):
        assert res[phase]["npu"]["npu_matmuls"] == 0 and res[phase]["npu"]["h2d_copies"] == 0
        assert res[phase]["cpu_ops"].get("addmm_", 0) == res["pairs"]
        assert res[phase]["cpu_ops"].get("mm", 0) == 0
    assert_weights_right(res)


def test_fused_leaves_upstream_device_path_alone_on_030():
    res = drive("0.30.0", env=FUSED_ON, local_device="npu:0", npu=True)
    assert res["status"]["lora-accel-delta"][0] == "skipped:version"
    for phase in ("load", "unload"):
        assert res[phase]["npu"]["npu_matmuls"] == res["pairs"]  # upstream's _resolve_lora_compute_device
        assert res[phase]["cpu_ops"].get("addmm_", 0) == 0
    assert_weights_right(res)


# ------------------------------------------------------------------------------ real stack (slow tier)

STACK_SCRIPT = r'''
import json, os, sys
sys.path.insert(0, os.environ["LORA_TESTS_DIR"])  # tests/support only (torch-only helpers); not the repo root
import torch
import omni_patches
from diffusers import WanTransformer3DModel
from vllm_omni.diffusion.lora.loader import LoraLoaderMixin
from support.omni_loader import expected_deltas, make_lora_state_dict

torch.manual_seed(0)
model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                              rope_max_seq_len=32)
with torch.no_grad():
    for p in model.parameters():  # diffusers zero-initialises some (biases): give every weight a magnitude
        p.normal_(0, 0.05)
sd = make_lora_state_dict(model, rank=4, bias=True, targets=["blocks."], seed=3)
ref = expected_deltas(sd, model)
before = {k: v.detach().double().clone() for k, v in model.named_parameters("transformer")}
keys = LoraLoaderMixin.load_lora_into_module(sd, model)
eps = torch.finfo(torch.float32).eps
load_err = max(((p.detach().double() - before[k] - ref[k]).abs().max().item()
                / (before[k].abs().max().item() + ref[k].abs().max().item())) for k, p in model.named_parameters("transformer")
               if k in ref)
LoraLoaderMixin.unload_module_lora(sd, model)
unload_err = max((p.detach().double() - before[k]).abs().max().item() / before[k].abs().max().item()
                 for k, p in model.named_parameters("transformer") if k in ref)
print("RESULT " + json.dumps({
    "omni_patches_file": omni_patches.__file__, "covered": len(ref), "keys": len(keys), "n_keys": len(sd),
    "load_rel_err": load_err / eps, "unload_rel_err": unload_err / eps,
    "status": {s.id: [s.state, s.reason] for s in omni_patches.status()},
}))
'''


@pytest.mark.stack
@pytest.mark.parametrize("version,fused,expect", [
    ("0.28.0", False, {"lora-accel-delta": ("applied", "patched"), "lora-cpu-fused-delta": ("skipped:disabled", "")}),
    ("0.28.0", True, {"lora-accel-delta": ("applied", "patched"), "lora-cpu-fused-delta": ("applied", "patched")}),
    ("0.30.0", False, {"lora-accel-delta": ("skipped:version", "fixed upstream in vllm-omni 0.30.0rc1")}),
    ("0.30.0", True, {"lora-accel-delta": ("skipped:version", "fixed upstream"),
                      "lora-cpu-fused-delta": ("applied", "patched")}),
])
def test_real_stack_fuses_lora_through_the_installed_shim(shimmed_stack, tmp_path, version, fused, expect):
    python = shimmed_stack(version)
    env = {k: v for k, v in without_switches().items() if k != "PYTHONPATH"}
    env.update(OMNI_PATCHES="1", LORA_TESTS_DIR=str(ROOT / "tests"))
    if fused:
        env["OMNI_PATCHES_LORA_CPU_FUSED_DELTA"] = "1"
    proc = subprocess.run([str(python), "-c", STACK_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert "site-packages" in res["omni_patches_file"], res["omni_patches_file"]  # the installed copy, via .pth
    for pid, (state, reason) in expect.items():
        got = res["status"][pid]
        assert got[0] == state and reason in got[1], (pid, got)
    assert res["covered"] >= 16 and res["keys"] == res["n_keys"], res
    # float32 weights: within a few ulps of the float64 reference, relative to the weights' magnitude.
    assert res["load_rel_err"] < 8 and res["unload_rel_err"] < 8, res
