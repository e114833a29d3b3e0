"""Every real patch in patches.toml passes the shared contract (see tests/support/contract.py)."""
import importlib
import pkgutil

import pytest

import cases
from omni_patches import registry
from support.contract import run_child

SPECS = registry.load([registry.builtin_path()]).specs
CASES = {}
for info in pkgutil.iter_modules(cases.__path__):
    CASES[info.name] = importlib.import_module(f"cases.{info.name}").CASE


def _params():
    for name, case in CASES.items():
        for kind, items in (("affected", case.affected), ("lazy", case.affected), ("skipped", case.skipped),
                            ("drifted", case.drifted), ("source", case.source_built)):
            for i, item in enumerate(items):
                env = item if kind in ("affected", "lazy") else item[0]
                yield pytest.param(name, kind, i, id=f"{case.patch_id}-{kind}-{env.label}")


def test_every_patch_has_a_contract_case():
    covered = {c.patch_id for c in CASES.values()}
    assert set(SPECS) <= covered, f"patches without a tests/cases/ entry: {sorted(set(SPECS) - covered)}"
    for case in CASES.values():
        assert case.affected and case.skipped and case.drifted, f"{case.patch_id}: every part of the contract"
        spec = SPECS.get(case.patch_id)
        if spec is not None and spec.source_builds == "features":  # decided by features: show it does
            assert any(state == "applied" for _, state, _ in case.source_built), \
                f"{case.patch_id}: a 'source build' variant that applies (tests/support/contract.py)"


@pytest.mark.parametrize("case_module,kind,index", list(_params()))
def test_contract(case_module, kind, index):
    report = run_child(case_module, kind, index)
    assert report["ok"], report
