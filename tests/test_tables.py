"""patches.toml and the README's patch table are generated from the patch modules (``omni_patches.tools.tables``):
the checkout's copies are what the tool writes, and the tool sees a changed, a new or a broken module."""
import shutil
import textwrap
from pathlib import Path

import pytest

from omni_patches import registry
from omni_patches.tools import tables

ROOT = Path(__file__).resolve().parents[1]


def test_the_checkout_holds_what_the_modules_generate():
    for path, text in tables.generated(ROOT).items():
        assert Path(path).read_text() == text, (
            f"{Path(path).name} is not what the patch modules generate: "
            "run python -m omni_patches.tools.tables --write")


def test_every_registry_key_but_id_module_and_prose_is_a_table_key():
    """A key the registry learns is one a module can declare (or the tool would drop it)."""
    from omni_patches import prose

    assert set(tables.TABLE_KEYS) == set(registry.KEYS) - {"id", "module"} - set(prose.KEYS)


@pytest.fixture
def checkout(tmp_path):
    """A copy of the files the tool reads and writes."""
    shutil.copytree(ROOT / "omni_patches" / "patches", tmp_path / "omni_patches" / "patches")
    for name in ("patches.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _run(capsys, root, *args):
    code = tables.main(["--root", str(root), *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_changed_table_is_seen_then_written(checkout, capsys, mocker):
    module = checkout / "omni_patches" / "patches" / "lora_accel_delta.py"
    module.write_text(module.read_text().replace('"default": True,', '"default": False,', 1))
    before = {name: (checkout / name).read_text() for name in ("patches.toml", "README.md")}

    code, out = _run(capsys, checkout)
    assert code == 1 and "out of date: patches.toml" in out and "out of date: README.md" in out, out
    assert {name: (checkout / name).read_text() for name in before} == before  # a check writes nothing

    spy = mocker.spy(tables, "render_toml")
    code, out = _run(capsys, checkout, "--write")
    assert code == 0 and "wrote: patches.toml" in out and spy.call_count == 1, out
    specs = registry.load([str(checkout / "patches.toml")]).specs
    assert specs["lora-accel-delta"].default is False
    assert list(specs) == list(registry.load([str(ROOT / "patches.toml")]).specs)  # order kept
    assert "| `lora-accel-delta` | `OMNI_PATCHES_LORA_ACCEL_DELTA` (off) |" in (checkout / "README.md").read_text()
    assert _run(capsys, checkout) == (0, "tables: patches.toml and the README's patch table are up to date\n")


def test_a_new_module_goes_last_with_its_record_and_table_and_a_shared_one_is_named(checkout, capsys):
    (checkout / "omni_patches" / "patches" / "aaa_new_fix.py").write_text(textwrap.dedent('''\
        """aaa-new-fix: a new fix

        Why:         x
        Upstream:    https://example.invalid/1
        Affected:    vllm >=0.1
        How:         y
        Remove when: z
        """

        TABLE = {"default": False, "requires": {"vllm": ">=0.1"}, "targets": ["vllm.x"]}


        def apply(ctx):
            pass
        '''))
    (checkout / "omni_patches" / "patches" / "_aaa_shared.py").write_text('"""Shared by aaa-new-fix."""\n')
    assert _run(capsys, checkout, "--write")[0] == 0
    specs = registry.load([str(checkout / "patches.toml")]).specs
    assert "omni_patches/patches/_aaa_shared.py" in (checkout / "patches.toml").read_text()  # named, not a patch
    assert list(specs)[-1] == "aaa-new-fix"  # first by name, last by order: the patches before keep theirs
    new = specs["aaa-new-fix"]
    assert (new.module, new.default, new.requires, new.targets, new.error) == (
        "omni_patches.patches.aaa_new_fix", False, {"vllm": ">=0.1"}, ["vllm.x"], None)
    table = (checkout / "README.md").read_text().split("<!-- patch-table:end -->")[0].rstrip().splitlines()
    assert table[-1].startswith("| `aaa-new-fix` | `OMNI_PATCHES_AAA_NEW_FIX` (off) | `vllm >=0.1` | — | a new fix |")


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.replace("TABLE = {", "NOT_TABLE = {", 1), "needs exactly one module-level TABLE"),
    (lambda t: t.replace('"default": True,', '"default": True, "summary": "x",', 1), "TABLE has key(s) ['summary']"),
    (lambda t: t.replace('"default": True,', '"default": bool(1),', 1), "TABLE must be a literal dict"),
    (lambda t: t.replace('"""lora-accel-delta:', '"""lora accel delta:', 1), "must open with its record"),
    (lambda t: t.replace('"targets": [', '"targets": "x", "unused": [', 1), "TABLE has key(s) ['unused']"),
])
def test_a_broken_module_is_named_and_nothing_is_written(checkout, capsys, edit, says):
    module = checkout / "omni_patches" / "patches" / "lora_accel_delta.py"
    module.write_text(edit(module.read_text()))
    before = (checkout / "patches.toml").read_text()
    code, out = _run(capsys, checkout, "--write")
    assert code == 2 and says in out and "lora_accel_delta.py" in out, out
    assert (checkout / "patches.toml").read_text() == before


def test_an_invalid_value_fails_the_generated_registry(checkout, capsys):
    module = checkout / "omni_patches" / "patches" / "lora_accel_delta.py"
    module.write_text(module.read_text().replace('"targets": ["vllm_omni.diffusion.lora.loader"]', '"targets": []', 1))
    code, out = _run(capsys, checkout, "--write")
    assert code == 2 and "the generated registry is not valid" in out and "lora-accel-delta" in out, out
