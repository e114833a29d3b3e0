"""The package's shape, checked on its source: no module reaches another's private names, state words are
compared as :class:`omni_patches.states.State`, never as string literals, and the patches reach the shim only
through their ``ctx``."""
import ast
from pathlib import Path

import omni_patches
from omni_patches.states import State

PACKAGE = Path(omni_patches.__file__).parent
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _imports(tree, path):
    """``{local name: module path}`` of the omni_patches modules ``tree`` imports, plus private names imported
    from another module (a sibling ``_helper`` module of the same package is the package's own)."""
    aliases, bad = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("omni_patches")):
            for a in node.names:
                aliases[a.asname or a.name] = node.module
                sibling_module = node.level == 1 and not node.module and (path.parent / f"{a.name}.py").exists()
                if _private(a.name) and not sibling_module:
                    bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: imports {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("omni_patches"):
                    aliases[a.asname or a.name.partition(".")[0]] = a.name
    return aliases, bad


def private_reaches(path, source):
    """Where ``source`` (the module at ``path``) imports or reads another module's private name."""
    tree = ast.parse(source, str(path))
    aliases, bad = _imports(tree, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases:
            bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value.id}.{node.attr}")
    return bad


def state_literals(path, source):
    """Where ``source`` compares something with a state word written as a string literal."""
    words, bad = {s.value for s in State}, []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for e in side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]:
                    if isinstance(e, ast.Constant) and e.value in words:
                        bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {e.value!r}")
    return bad


def test_no_module_reaches_anothers_private_names():
    bad = [b for path in SOURCES for b in private_reaches(path, path.read_text())]
    assert not bad, "\n".join(bad)


def test_state_words_are_compared_typed():
    bad = [b for path in SOURCES if path.name != "states.py" for b in state_literals(path, path.read_text())]
    assert not bad, "\n".join(bad)


def test_the_checks_find_what_they_forbid():
    src = ("from . import engine\nfrom .engine import _lock\nfrom . import _bootstrap\n"
           "if engine._state.x == 'applied' or engine.y in ('drifted', 'other'):\n    pass\n")
    path = PACKAGE / "example.py"
    assert private_reaches(path, src) == ["example.py:2: imports _lock", "example.py:4: engine._state"]
    assert state_literals(path, src) == ["example.py:4: 'applied'", "example.py:4: 'drifted'"]
    assert private_reaches(path, "from . import engine\nengine.snapshot()\n") == []


# -- the patches act only through ctx ------------------------------------------------------------------------
# What a patch module may import from the shim besides its own package (``patches/_*.py`` helpers): the logger
# and version parsing. Its record, the targets and every change reach it as ``ctx`` (omni_patches.context).
PATCH_IMPORTS = {"omni_patches.log", "omni_patches.versions"}


def patch_imports(path, source):
    """Where the patch module at ``path`` imports a part of the shim other than :data:`PATCH_IMPORTS` (the engine,
    ``runs`` / ``PatchRun``, ...)."""
    bad = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # omni_patches/patches/<module>.py: "." is omni_patches.patches, ".." omni_patches
                base = ".".join(["omni_patches", "patches"][:3 - node.level] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "omni_patches" or name.startswith("omni_patches.patches."):
                continue
            if not any(name == ok or name.startswith(ok + ".") for ok in PATCH_IMPORTS):
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: imports {name}")
    return bad


def test_patches_reach_the_shim_only_through_ctx():
    bad = [b for path in SOURCES if path.parent.name == "patches" for b in patch_imports(path, path.read_text())]
    assert not bad, "\n".join(bad)


def test_the_patch_check_finds_what_it_forbids():
    src = ("from .. import engine\nfrom ..runs import PatchRun\nfrom omni_patches import runs\n"
           "import omni_patches.engine\nfrom .. import log, versions\nfrom . import _lora_call\n"
           "from omni_patches.log import once\n")
    path = PACKAGE / "patches" / "example.py"
    assert patch_imports(path, src) == [
        "patches/example.py:1: imports omni_patches.engine",
        "patches/example.py:2: imports omni_patches.runs.PatchRun", "patches/example.py:3: imports omni_patches.runs",
        "patches/example.py:4: imports omni_patches.engine"]
