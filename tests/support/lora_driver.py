"""The LoRA scenario driver shared by lora-accel-delta's and lora-cpu-fused-delta's tests on the REAL vllm-omni
loader.py (sandbox, tests/support/omni_loader.py).

:func:`drive` runs DRIVER in a fresh interpreter: the real loader of one release, the shim activated with
OMNI_PATCHES=1 (switches per scenario), optionally the simulated ``npu`` (tests/support/fake_npu.py, installed
after the loader import as it must be), a small transformer-like module with a stacked ``to_qkv`` (+bias),
a plain projection and a bias, and a LoRA that covers every one of them. The driver loads, then unloads,
and reports what ran where (npu counters, CPU aten ops seen by a TorchDispatchMode) and how far the
weights are from a float64 reference.
"""
from __future__ import annotations

import json

from support.omni_loader import run_sandboxed

DRIVER = r'''
import json, os, sys
import torch
import omni_patches

cfg = json.loads(os.environ["LORA_TEST_CFG"])
omni_patches.activate()
import vllm_omni.diffusion.lora.loader as L
import vllm_omni.diffusion.distributed.utils as U
from support import fake_npu
from support.omni_loader import expected_deltas, make_lora_state_dict, tiny_transformer
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
