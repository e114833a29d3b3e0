"""Each patch module opens with its record, and the record mirrors its patches.toml entry."""
import importlib
from pathlib import Path

import pytest

from omni_patches import registry

DOCS = Path(__file__).resolve().parents[1] / "docs" / "patches.md"
SPECS = registry.load([registry.builtin_path()]).specs
FIELDS = ("Why:", "Upstream:", "Affected:", "How:", "Remove when:")
MAX_RECORD_LINES = 25  # a screenful; the long form goes to the patch's section in docs/patches.md


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


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_record_fits_a_screenful(pid):
    """The record is read by an operator: its fields in order, at most MAX_RECORD_LINES lines as written in the
    file (opening and closing quotes included); measurements and test narrative live in docs/patches.md."""
    spec = SPECS[pid]
    doc = importlib.import_module(spec.module).__doc__ or ""
    lines = doc.count("\n") + 1
    assert lines <= MAX_RECORD_LINES, f"{spec.module}: record is {lines} lines (at most {MAX_RECORD_LINES})"
    starts = [next((i for i, line in enumerate(doc.splitlines()) if line.startswith(label)), -1) for label in FIELDS]
    assert -1 not in starts and starts == sorted(starts), f"{spec.module}: fields missing or out of order {starts}"
    anchor = f"## `{pid}`"
    assert anchor in DOCS.read_text(), f"docs/patches.md lacks the section {anchor!r} the record's long form goes to"
