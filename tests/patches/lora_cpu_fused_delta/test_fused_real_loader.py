"""lora-cpu-fused-delta on the REAL vllm-omni loader.py: each scenario runs the shared driver
(tests/support/lora_driver.py) in a fresh interpreter (with lora-accel-delta beside it where they compose); the slow
tier runs the real stacks through the installed shim, with vLLM's real parameter classes.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support.lora_driver import FUSED_ON, assert_weights_right, drive
from support.venvs import without_switches

ROOT = Path(__file__).resolve().parents[3]


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


def test_which_weights_the_fused_path_writes_into():
    # The verdict per tensor type (the real vLLM classes: the stack tier below). A subclass is written through
    # only when nothing of it can see the op: no __torch_function__ of its own (or vLLM's known pass-through,
    # recognised by its module), no __torch_dispatch__, add_/sub_ or data of its own.
    import torch

    from omni_patches.patches import lora_cpu_fused_delta as F

    F.load_torch()

    class Tagged(torch.nn.Parameter):  # e.g. set_weight_attrs-style extra attributes only
        pass

    class Own(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    class PassThrough(Own):  # what vllm/model_executor/parameter.py defines, by module
        pass

    Own.__module__ = PassThrough.__module__ = "vllm.model_executor.parameter"

    class Shared(PassThrough):
        data = property(lambda self: None)

    class Local(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    class Adds(torch.Tensor):
        def add_(self, other, **kw):
            return super().add_(other, **kw)

    assert [F.holder(c) for c in (torch.Tensor, torch.nn.Parameter, Tagged, Own, PassThrough)] == \
        ["plain", "plain", "plain", "mode", "mode"]
    for cls, name in ((Shared, "data"), (Local, "__torch_function__"), (Adds, "add_")):
        assert F.holder(cls).endswith(f"a tensor subclass with its own {name}"), F.holder(cls)


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


# vllm-omni's own DiT holds vLLM's parameter classes (issue 19): the weights of vLLM's linear layers are
# ModelWeightParameter, whose __torch_function__ defers to Parameter's disabled handler -- before the fix the
# fused patch's stand-in reached add_() through it and the server failed to start (TypeError: add_(): argument
# 'other' (position 1) must be Tensor, not _Stack). Here: vLLM's real QKVParallelLinear / RowParallelLinear /
# ColumnParallelLinear (the layers omni's Wan attention uses) in a world of one (gloo, loopback), vllm-omni's
# real loader, bf16 and fp32 LoRAs; the fused result against stock's and a float64 reference.
#
# The bound (per element, stated): with u(x) = eps(dtype)/2 * |x| the rounding error of x in a dtype, and
# acc = 2 * (rank + 2) * 2^-24 * (|W| + |B| @ |A|) the fp32 accumulation error (GEMM and add),
#   fused: |fused - ref| <= u_w(ref) + acc                (one rounding into the weight's dtype)
#   stock: |stock - ref| <= u_w(ref) + u_d(B @ A) + acc    (the product rounded to the delta's dtype d -- the
#          LoRA's for a bf16 LoRA, the weight's after `.to(param.dtype)` for an fp32 one -- then the sum)
# so |fused - stock| <= both together; the fused error's RMS is also no larger than stock's.
VLLM_PARAM_SCRIPT = r"""
import json, os, socket, sys
sys.path.insert(0, os.environ["LORA_TESTS_DIR"])
import torch
import omni_patches
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.parameter import BasevLLMParameter
from vllm_omni.diffusion.lora.loader import LoraLoaderMixin
from support.omni_loader import expected_deltas, make_lora_state_dict

PAIRS = [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "bfloat16")]  # (weights, LoRA)
H, RANK = 64, 8
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()


def build(dtype):
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_qkv = QKVParallelLinear(hidden_size=H, head_size=H // 4, total_num_heads=4, bias=True,
                                            params_dtype=dtype)
            self.to_out = RowParallelLinear(H, H, bias=True, params_dtype=dtype, return_bias=False)
            self.ffn_up = ColumnParallelLinear(H, 2 * H, bias=False, params_dtype=dtype, return_bias=False)

    class DiT(torch.nn.Module):
        stacked_params_mapping = [(".to_qkv", ".to_q", "q"), (".to_qkv", ".to_k", "k"), (".to_qkv", ".to_v", "v")]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Attention() for _ in range(2))

    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        model = DiT()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)

cases = {}
for wname, lname in PAIRS:
    model = build(getattr(torch, wname))
    sd = make_lora_state_dict(model, rank=RANK, bias=True, seed=1, scale=0.3, dtype=getattr(torch, lname))
    cases[(wname, lname)] = (model, sd, {k: v.detach().clone() for k, v in model.named_parameters("transformer")})


def run():
    out = {}
    for (wname, lname), (model, sd, before) in cases.items():
        params = dict(model.named_parameters("transformer"))
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(before[k])
        mode = Ops()
        with mode:
            keys = LoraLoaderMixin.load_lora_into_module(sd, model)
        loaded = {k: v.detach().clone() for k, v in params.items()}
        LoraLoaderMixin.unload_module_lora(sd, model)
        unloaded = {k: v.detach().clone() for k, v in params.items()}
        out[(wname, lname)] = dict(keys=len(keys), n_keys=len(sd), loaded=loaded, unloaded=unloaded, ops=mode.ops,
                                   mode_left_on=torch._C._is_torch_function_mode_enabled(),
                                   types=sorted({type(p).__name__ for p in params.values()}))
    return out


patched = run()
status = {s.id: [s.state, s.reason] for s in omni_patches.status()}
omni_patches.unapply_all()
stock = run()

res = {"status": status, "cases": {}}
for (wname, lname), (model, sd, before) in cases.items():
    weps, deps = torch.finfo(getattr(torch, wname)).eps, torch.finfo(getattr(torch, wname if lname == "float32"
                                                                                else lname)).eps
    ref = expected_deltas(sd, model)
    A = {k[: -len(".lora_A.weight")]: v for k, v in sd.items() if k.endswith(".lora_A.weight")}
    worst = {"fused": 0.0, "stock": 0.0, "fused_vs_stock": 0.0, "unload": 0.0}
    sq = {"fused": 0.0, "stock": 0.0}
    n = 0
    for k, delta in ref.items():
        w0 = before[k].double()
        want = w0 + delta
        absdelta = delta.abs()
        if k.endswith(".weight"):  # |B| @ |A| per shard, from the state dict (stacked: the shards' rows)
            base = k[: -len(".weight")]
            shards = [b for b in A if b == base or b == base.replace(".to_qkv", ".to_q")
                      or b == base.replace(".to_qkv", ".to_k") or b == base.replace(".to_qkv", ".to_v")]
            absdelta = torch.cat([sd[f"{b}.lora_B.weight"].double().abs() @ sd[f"{b}.lora_A.weight"].double().abs()
                                  for b in shards])
        acc = 2 * (RANK + 2) * 2.0 ** -24 * (w0.abs() + absdelta)
        fused_tol = weps / 2 * want.abs() + acc
        stock_tol = fused_tol + deps / 2 * delta.abs()
        f, st = patched[(wname, lname)]["loaded"][k].double(), stock[(wname, lname)]["loaded"][k].double()
        worst["fused"] = max(worst["fused"], ((f - want).abs() / fused_tol).max().item())
        worst["stock"] = max(worst["stock"], ((st - want).abs() / stock_tol).max().item())
        worst["fused_vs_stock"] = max(worst["fused_vs_stock"], ((f - st).abs() / (fused_tol + stock_tol)).max().item())
        u = patched[(wname, lname)]["unloaded"][k].double()
        worst["unload"] = max(worst["unload"], ((u - w0).abs() / (weps * f.abs() + 2 * acc)).max().item())
        sq["fused"] += (f - want).pow(2).sum().item(); sq["stock"] += (st - want).pow(2).sum().item()
        n += f.numel()
    p, s = patched[(wname, lname)], stock[(wname, lname)]
    res["cases"][f"{wname}/{lname}"] = {
        "worst": worst, "rms": {k: (v / n) ** 0.5 for k, v in sq.items()}, "covered": len(ref),
        "keys": [p["keys"], s["keys"], p["n_keys"]], "types": p["types"], "mode_left_on": p["mode_left_on"],
        "mm": [p["ops"].get("mm", 0), s["ops"].get("mm", 0)], "addmm_": p["ops"].get("addmm_", 0),
        "same_as_stock": all(torch.equal(p["loaded"][k], s["loaded"][k]) for k in ref)}
res["base_is_vllm"] = issubclass(type(cases[PAIRS[0]][0].blocks[0].to_qkv.weight), BasevLLMParameter)
print("RESULT " + json.dumps(res))
"""


@pytest.mark.stack
@pytest.mark.parametrize("version", ["0.28.0", "0.30.0", "0.32.0rc1"])
def test_real_stack_fuses_into_vllm_parameter_classes(shimmed_stack, tmp_path, version):
    python = shimmed_stack(version)
    env = {k: v for k, v in without_switches().items() if k != "PYTHONPATH"}
    env.update(OMNI_PATCHES="1", OMNI_PATCHES_LORA_CPU_FUSED_DELTA="1", LORA_TESTS_DIR=str(ROOT / "tests"),
               MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([str(python), "-c", VLLM_PARAM_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["base_is_vllm"], "the weights are not vLLM parameter classes: the test would prove nothing"
    state, reason = res["status"]["lora-cpu-fused-delta"]
    assert state == "applied", reason
    for pair, case in res["cases"].items():
        assert case["types"] == ["ModelWeightParameter", "Parameter"], (pair, case["types"])
        assert case["keys"][0] == case["keys"][1] == case["keys"][2] and case["covered"] == 10, (pair, case)
        # The fused path ran (no product materialised) where stock multiplies every pair, and left no mode on.
        assert case["mm"][0] == 0 and case["mm"][1] > 0 and case["addmm_"] > 0, (pair, case)
        assert not case["mode_left_on"], pair
        worst = case["worst"]
        assert worst["stock"] <= 1, (pair, worst)  # the bound is right about stock ...
        assert worst["fused"] <= 1 and worst["fused_vs_stock"] <= 1 and worst["unload"] <= 1, (pair, worst)
        assert case["rms"]["fused"] <= case["rms"]["stock"], (pair, case["rms"])
        if not case["same_as_stock"]:
            assert case["rms"]["fused"] < case["rms"]["stock"], (pair, case["rms"])
    # status says which path ran for each pair (6 weights and 4 biases, loaded and unloaded), and why for the mixed
    # ones.
    for path in ("bf16 LoRA on bf16 weights: ", "fp32 LoRA on bf16 weights: fp32 row-blocked x12",
                 "bf16 LoRA on fp32 weights: addmm_ in fp32 of the widened bf16 factors x12",
                 "bf16 bias delta on bf16: add_ in place x8", "fp32 bias delta on bf16: add_ in place x8"):
        assert path in reason, (path, reason)
    assert "fp32 LoRA on bf16 weights: fp32 row-blocked (the fp32 factors multiplied in fp32 as stock does; one " \
           "rounding into bf16 (stock: two))" in reason, reason
    assert "ran the original code" not in reason, reason
