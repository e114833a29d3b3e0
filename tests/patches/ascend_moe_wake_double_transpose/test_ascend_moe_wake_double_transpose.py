"""ascend-moe-wake-double-transpose on the REAL ``NPUWorker.sleep`` / ``wake_up`` and the REAL
``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` of every vllm-ascend release on PyPI from 0.12.0rc1
to 0.25.1rc1, on real torch (CPU); torch_npu, CaMem and the Ascend config are stand-ins (``case.py``).

Per release, one child: a two-layer MoE model whose expert weights the release's own process-after-loading put in the
runtime layout, then the release's own worker sleeps and wakes in three flows (a server's plain wake_up; the two-phase
wake, weights then KV cache; a level-2 sleep woken for a weight reload), stock, then with the shim active. Stock ends
with w13 / w2 transposed twice and the next forward failing on the matmul's shape; patched, every expert weight has
exactly the shapes, values (and Parameter objects) that upstream's fixed release, 0.26.0rc1, run in a child of its own
on the same inputs, leaves, and the forward gives 0.26.0rc1's output. With the patch's switch off (a trainer on the
pre-0.26 contract: wake_up hands it the checkpoint layout) every release behaves as stock.
"""
import pytest

from patches.ascend_moe_wake_double_transpose import case

MISMATCH = "shapes cannot be multiplied"
RELOAD = "must match the size of tensor b"  # copy_ of the processed weight into a tensor of the other layout
CHECKPOINT = {"w13_weight": [case.E, 2 * case.I, case.H], "w2_weight": [case.E, case.H, case.I]}
RUNTIME = {"w13_weight": [case.E, case.H, 2 * case.I], "w2_weight": [case.E, case.I, case.H]}


def _layouts(shapes, layout):
    return all(shape == layout[name.rsplit(".", 1)[1]] for name, shape in shapes.items())


def _swapped(shape):
    return [shape[0], shape[2], shape[1]]


@pytest.fixture(scope="module")
def fixed():
    """Upstream's fixed release on the same flows: what every patched release must leave."""
    out = case.release("0.26.0rc1").call(case.stock_then_patched, "0.26.0rc1", False)
    assert out["layout"] == "none"
    for name, res in out["stock"].items():
        assert res["after"] == res["before"], name  # the weights as loaded: shapes and values
        assert _layouts({k: v[0] for k, v in res["after"].items()}, RUNTIME), name
        assert res["same_objects"] is True, name
        assert res["forward_after"] == res["forward_before"] and res["forward_after"]["ok"], name
    # RL: the weights wake in the runtime layout, and the reload writes into them
    assert out["stock"]["level2_reload"]["reload"] == "ok"
    assert _layouts(out["stock"]["level2_reload"]["at_reload"], RUNTIME)
    return out["stock"]


@pytest.mark.parametrize("version", case.AFFECTED)
def test_stock_transposes_twice_and_the_patch_leaves_what_0_26_leaves(version, fixed):
    out = case.release(version).call(case.stock_then_patched, version)
    assert out["layout"] == "retransposes"
    for name in case.FLOWS:
        stock, patched = out["stock"][name], out["patched"][name]
        # The same model as 0.26.0rc1 builds: the release's process-after-loading gives the same runtime layout.
        assert stock["before"] == patched["before"] == fixed[name]["before"], name
        # Stock: every expert weight transposed again (a new Parameter over the same memory); the next forward fails.
        assert {k: v[0] for k, v in stock["after"].items()} == \
            {k: _swapped(v[0]) for k, v in stock["before"].items()}, name
        assert stock["same_objects"] is False
        assert stock["forward_after"]["ok"] is False and MISMATCH in stock["forward_after"]["error"], name
        # Patched: 0.26.0rc1's shapes, values, objects and forward output.
        for key in ("after", "same_objects", "forward_after", "reload"):
            assert patched[key] == fixed[name][key], (name, key)
        assert patched["forward_after"]["out"] == patched["forward_before"]["out"], name
    # The reload after a level-2 wake: stock hands it the checkpoint layout (the pre-0.26 contract) and vLLM's
    # in-place copy of the processed weights fails; patched, the runtime layout, as 0.26.0rc1.
    stock, patched = out["stock"]["level2_reload"], out["patched"]["level2_reload"]
    assert _layouts(stock["at_reload"], CHECKPOINT) and RELOAD in stock["reload"]
    assert patched["at_reload"] == fixed["level2_reload"]["at_reload"]
    assert out["status"]["state"] == "applied", out["status"]
    assert "NPUWorker.wake_up transposes w13_weight / w2_weight" in out["status"]["reason"]
    assert "MoE weight(s) kept in the runtime layout" in out["status_after"]["reason"]


@pytest.mark.parametrize("version", ["0.12.0rc1", "0.25.1rc1"])
def test_switched_off_every_flow_is_stock(version):
    """The pre-0.26 trainer contract, kept with OMNI_PATCHES_ASCEND_MOE_WAKE_DOUBLE_TRANSPOSE=0: wake_up hands over the
    checkpoint layout, exactly as stock."""
    out = case.release(version).call(case.stock_then_patched, version, env={case.SWITCH: "0"})
    assert out["status"] == {"state": "skipped:disabled", "reason": f"{case.SWITCH}=0"}
    assert out["patched"] == out["stock"]
    assert _layouts(out["patched"]["level2_reload"]["at_reload"], CHECKPOINT)


@pytest.mark.parametrize("version", [*case.BEFORE, *case.FIXED])
def test_outside_the_range_wake_up_transposes_nothing(version):
    out = case.release(version).call(case.outside, version)
    assert out["layout"] == "none"
    assert out["state"] == "skipped:version", out
    assert ("fixed upstream in vllm-ascend 0.26.0rc1" if version in case.FIXED else "outside") in out["reason"]
