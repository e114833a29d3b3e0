"""The README says what is true of this checkout (its patch table: tests/test_tables.py)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


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


def _anchors(path):
    """GitHub's heading anchors of a markdown file (headings inside code fences are not headings)."""
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_doc_links_resolve():
    """The README is the operator's page; the rest lives in docs/, bench/README.md and CONTRIBUTING.md. Every
    relative link among them names a file that exists and, with #anchor, a heading in it."""
    root = README.parent
    pages = [README, root / "CONTRIBUTING.md", root / "bench" / "README.md", *sorted((root / "docs").glob("*.md"))]
    linked = set()
    broken = []
    for page in pages:
        assert page.exists(), page
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            linked.add(dest)
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(root)}: {target}")
    assert not broken, broken
    assert set(pages[1:]) <= linked, "a doc page no other page links to"
