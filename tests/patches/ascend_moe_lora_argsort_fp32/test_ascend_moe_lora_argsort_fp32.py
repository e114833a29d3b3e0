"""ascend-moe-lora-argsort-fp32 on the REAL ``vllm_ascend/lora/fused_moe.py`` (and 0.27.1rc1's ``quant_moe.py``) of
every vllm-ascend release on PyPI from 0.23.0rc1 to 0.30.0rc2, on real torch (CPU); torch_npu a stand-in (``case.py``).

Per affected release, one child: the routing function on the same inputs stock, then with the shim active: stock
argsorts integer keys (the slow kind on the NPU), the patched function float32 keys, and both give exactly the
routing of upstream's fixed release (0.28.0rc1's own function, run on the same inputs in a child of its own). Speed is
the NPU's (upstream's table); on this CPU it is measured, not asserted (``bench/moe_lora_argsort.py``).
"""
import pytest

from omni_patches.patches import ascend_moe_lora_argsort_fp32 as patch
from omni_patches.runs import PatchRun
from patches.ascend_moe_lora_argsort_fp32 import case
from support import ascend_real

# (tokens, top_k, experts, seed, kind): see case.routing_inputs.
SPECS = [
    [1, 1, 1, 0, "routed"], [0, 2, 8, 1, "routed"], [7, 2, 8, 2, "routed"], [16, 4, 4, 3, "routed"],
    [32, 2, 8, 4, "signed"], [128, 8, 64, 5, "routed"], [512, 6, 60, 6, "int64"], [2048, 8, 128, 7, "routed"],
    [4096, 8, 128, 8, "signed"], [100, 4, 16, 9, "short_slots"], [64, 4, 16, 10, "ties"], [4096, 8, 64, 11, "ties"],
]
TIES = {i for i, s in enumerate(SPECS) if s[4] == "ties"}
INTS = {"torch.int32", "torch.int64"}


def test_every_pypi_release_is_covered():
    """The range's releases and the fixed ones are every vllm-ascend release on PyPI from the MoE-LoRA branch on."""
    assert set(case.AFFECTED) | set(case.FIXED) == set(ascend_real.RELEASES)
    assert case.BEFORE in ascend_real.BEFORE


@pytest.fixture(scope="module")
def fixed():
    """Upstream's fixed function (0.28.0rc1) on SPECS: the routing every patched release must give."""
    out = case.release("0.28.0rc1").call(case.stock_then_patched, SPECS, False)
    assert out["stock_dtypes"] == ["torch.float32"] * len(SPECS), "0.28.0rc1 argsorts float32 keys"
    return out["stock"]


@pytest.mark.parametrize("version", sorted(case.AFFECTED))
def test_stock_argsorts_integers_patched_float32_same_routing_as_fixed(version, fixed):
    out = case.release(version).call(case.stock_then_patched, SPECS)
    name = case.AFFECTED[version]
    assert out["name"] == name
    assert out["state"] == "applied", out["reason"]
    assert f"{name} argsorts torch.abs(expanded_row_idx) (integer keys)" in out["reason"]
    # Stock: one argsort per call, of integer keys (int32 from npu_moe_init_routing; int64 where given so).
    assert len(out["stock_dtypes"]) == len(SPECS) and set(out["stock_dtypes"]) <= INTS
    assert "torch.int32" in out["stock_dtypes"]
    # Patched: one argsort per call, of float32 keys.
    assert out["patched_dtypes"] == ["torch.float32"] * len(SPECS)
    for i, spec in enumerate(SPECS):
        assert out["patched"][i] == fixed[i], (version, spec)  # upstream's fixed routing, ties included
        if i not in TIES:  # a permutation (what the NPU op gives): stock's routing too
            assert out["patched"][i] == out["stock"][i], (version, spec)
    # unquant_apply_mlp's call-time `from vllm_ascend.lora.fused_moe import ...` (0.25.1rc1+) gets the patched one
    assert out["imported_is_patched"]


@pytest.mark.parametrize("version", case.FIXED)
def test_fixed_releases_skip_and_already_argsort_float32(version, fixed):
    out = case.release(version).call(case.stock_then_patched, SPECS[:4], True)
    assert out["state"] == "skipped:version" and "fixed upstream in vllm-ascend 0.28.0rc1" in out["reason"]
    assert out["stock_dtypes"] == out["patched_dtypes"] == ["torch.float32"] * 4
    assert out["stock"] == out["patched"] == fixed[:4]


@pytest.mark.parametrize("version", [v for v, n in case.AFFECTED.items() if n == case.NAMES[1]])
def test_moe_lora_apply_w13_hands_the_same_routing_to_the_kernel(version):
    """0.23.x / 0.24.0rc1: the real caller, ``moe_lora_apply_w13``, reaches the patched function (a module global
    looked up at call time) and passes the punica wrapper the same expert ids and LoRA slots."""
    out = case.release(version).call(case.caller_sees_patch, [2048, 8, 128, 12, "routed"])
    assert out["state"] == "applied"
    assert out["stock"]["dtypes"] == ["torch.int32"] and out["patched"]["dtypes"] == ["torch.float32"]
    assert {k: out["stock"][k] for k in ("experts", "slots")} == {k: out["patched"][k] for k in ("experts", "slots")}


@pytest.mark.parametrize("before", [True, False], ids=["shim-first", "imported-first"])
def test_quant_moe_binding_is_patched_and_restored(before):
    """0.27.1rc1's ``quant_moe`` imports the function by name: patched whichever came first, restored on unapply."""
    out = case.release("0.27.1rc1").call(case.quant_binding, [256, 8, 32, 13, "routed"], before)
    assert out["state"] == "applied"
    assert out["patched"] and out["dtypes"] == ["torch.float32"]
    assert out["same_object"] is before  # shim first: the import took fused_moe's replacement itself
    assert out["unapplied"] and out["restored"]
    assert out["after_dtypes"] == ["torch.int32"] and out["after"] == out["results"]


# -- the replacement itself (no release code) ---------------------------------------------------------------
def _recording_original():
    seen = []

    def _recover_moe_lora_routing_allgather(lora_context, expanded_row_idx, topk_ids):
        seen.append(expanded_row_idx)
        return "routed"

    return _recover_moe_lora_routing_allgather, seen


@pytest.mark.parametrize("keys,note", [
    (lambda torch: torch.zeros(1, dtype=torch.int32).expand(patch.EXACT_ROWS + 1), "more than 2**24 rows"),
    (lambda torch: torch.arange(4, dtype=torch.float16), "is not an integer tensor"),
    (lambda torch: [0, 1, 2], "is not a torch.Tensor"),
])
def test_inputs_it_was_not_built_for_run_the_original(keys, note):
    import torch

    original, seen = _recording_original()
    run = PatchRun.standalone(patch.PATCH_ID)
    recover = patch.make_fp32_keys(original, run)
    key = keys(torch)
    assert recover(None, key, None) == "routed" and len(seen) == 1 and seen[0] is key
    assert any(note in f for f in run.fallbacks), run.fallbacks


def test_exact_rows_keep_integer_order_in_float32():
    """2**24 rows at most: every position is exact in float32 (the next integer is not)."""
    import torch

    edge = torch.tensor([patch.EXACT_ROWS - 1, patch.EXACT_ROWS, patch.EXACT_ROWS + 1], dtype=torch.int64)
    assert edge[:2].to(torch.float32).to(torch.int64).tolist() == edge[:2].tolist()
    assert edge[2].to(torch.float32).to(torch.int64).item() != edge[2].item()
    original, seen = _recording_original()
    recover = patch.make_fp32_keys(original, PatchRun.standalone(patch.PATCH_ID))
    recover(None, torch.tensor([3, -1, 2], dtype=torch.int32), None)
    assert seen[0].dtype == torch.float32 and seen[0].tolist() == [3.0, -1.0, 2.0]


@pytest.mark.parametrize("body,want", [
    ("expanded = torch.abs(expanded_row_idx)\n    inv = torch.argsort(expanded)\n    return inv", patch.AFFECTED),
    ("inv = torch.argsort(torch.abs(expanded_row_idx))\n    return inv", patch.AFFECTED),
    ("expanded = torch.abs(expanded_row_idx).to(torch.float32)\n    return torch.argsort(expanded)", patch.FIXED),
    ("return torch.argsort(torch.abs(expanded_row_idx).float())", patch.FIXED),
    ("expanded = torch.abs(expanded_row_idx)\n    return torch.argsort(expanded), expanded", None),
    ("return torch.argsort(torch.abs(expanded_row_idx), descending=True)", None),
    ("return torch.argsort(expanded_row_idx)", None),
    ("return torch.argsort(torch.abs(expanded_row_idx)), expanded_row_idx", None),
    ("return torch.sort(torch.abs(expanded_row_idx)).indices", None),
])
def test_argsort_key_reader(body, want, tmp_path):
    import importlib.util

    src = tmp_path / "routing_src.py"
    src.write_text(f"import torch\n\ndef recover(lora_context, expanded_row_idx, topk_ids):\n    {body}\n")
    spec = importlib.util.spec_from_file_location("routing_src", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert patch.argsort_key(mod.recover)[0] == want, patch.argsort_key(mod.recover)


def test_the_reader_on_every_release_file():
    """The source reader on the real release files: integer keys in the range, float keys from the fix on."""
    import ast
    import linecache

    for version in [*case.AFFECTED, *case.FIXED]:
        text = (ascend_real.release_dir(version) / case.FM).read_text()
        fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name in case.NAMES)
        assert fn.name == case.AFFECTED.get(version, case.NAMES[0]), version
        source = ast.get_source_segment(text, fn)
        filename = f"<omni-test vllm-ascend {version} routing>"  # inspect.getsource reads it from linecache
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ns = {}
        exec(compile(source, filename, "exec"), ns)
        state, found = patch.argsort_key(ns[fn.name])
        assert state == (patch.FIXED if version in case.FIXED else patch.AFFECTED), (version, found)
