"""The README's patch table is generated from patches.toml; this keeps the two in sync."""
import re
from pathlib import Path

from omni_patches.cli import registry_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_patch_table_matches_registry():
    text = README.read_text()
    m = re.search(r"<!-- patch-table:start[^>]*-->\n(.*?)\n<!-- patch-table:end -->", text, re.S)
    assert m, "README lacks the patch-table markers"
    assert m.group(1).strip() == registry_markdown().strip(), (
        "README patch table is stale: replace it with the output of `omni-patches list`")


def test_readme_commands_exist():
    text = README.read_text()
    root = README.parent
    for path in ("examples/run_default.py", "examples/serve.py", "bench/run", ".ci/run"):
        assert path in text and (root / path).exists(), path
    ci = (root / ".ci" / "run").read_text()
    test_cmd = re.search(r"```bash\n(python3 -m venv \.venv && .*pytest)\n```", text)
    assert test_cmd, "README lacks the test command"
    for step in test_cmd.group(1).split(" && "):
        assert step.replace(".venv/bin/", "").split()[0] in ci, step
