"""lora-accel-delta on the REAL vllm-omni loader.py: each scenario runs the shared driver
(tests/support/lora_driver.py) in a fresh interpreter, with the simulated ``npu`` where a test needs an accelerator
(tests/support/fake_npu.py), and checks what ran where and how far the weights are from a float64 reference."""
from __future__ import annotations

import pytest

from support.lora_driver import ACCEL_OFF, assert_weights_right, drive


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
