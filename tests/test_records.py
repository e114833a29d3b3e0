"""Each patch module opens with its record, and the record mirrors its patches.toml entry."""
import importlib

import pytest

from omni_patches import registry

SPECS = registry.load([registry.builtin_path()]).specs
FIELDS = ("Fixes:", "Upstream:", "Affected:", "How:", "Remove when:")


def test_registry_is_valid():
    from omni_patches import gates

    reg = registry.load([registry.builtin_path()])
    assert not reg.errors
    for spec in reg.specs.values():
        assert spec.error is None, spec.error
        assert not gates.check_spec(spec)
        assert spec.module.startswith("omni_patches.patches."), spec.module
        assert spec.summary and spec.upstream and spec.why and spec.remove_when


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_record_mirrors_registry(pid):
    spec = SPECS[pid]
    doc = importlib.import_module(spec.module).__doc__ or ""
    assert doc.startswith(f"{pid}:"), f"{spec.module} must open with '{pid}: <summary>'"
    for label in FIELDS:
        assert label in doc, f"{spec.module}: record lacks {label!r}"
    for url in spec.upstream:
        assert url in doc, f"{spec.module}: record lacks upstream link {url}"
    for dist, specifier in spec.requires.items():
        assert f"{dist} {specifier}" in doc, f"{spec.module}: record lacks 'Affected: {dist} {specifier}'"
    for dist, version in spec.fixed_in.items():
        assert f"fixed upstream in {dist} {version}" in doc
