"""The package's shape, checked on its source: no module reaches another's private names (nor do the tests and
benchmarks), state words are compared as :class:`omni_patches.states.State`, never as string literals, and the
patches reach the shim only through their ``ctx``. (The import graph and its layers: tests/test_layers.py.)"""
import ast
from pathlib import Path

import omni_patches
from omni_patches.states import State

PACKAGE = Path(omni_patches.__file__).parent
REPO = PACKAGE.parent
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
# Code outside the package that uses it: the tests (with their support modules) and the benchmarks.
USERS = sorted(p for d in ("tests", "bench") for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)
# The import roots whose modules' private names are theirs alone: the package, and the test code's own two roots
# (tests/ is on sys.path: ``support.*`` helpers, ``patches.<id>.*`` cases and environments).
ROOTS = {"omni_patches": PACKAGE, "support": REPO / "tests" / "support", "patches": REPO / "tests" / "patches"}


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


# -- outside the package: tests and benchmarks use only its public names ---------------------------------------
_NAMED = ("getattr", "setattr", "hasattr", "delattr", "object")  # f(module, "_name"): patch.object, setattr, ...


def _package_modules(tree):
    """``{local name: omni_patches module}`` bound in ``tree``: imports, and ``x = importlib.import_module(...)``
    / ``sys.modules.get(...)`` / ``sys.modules[...]`` of a literal name (or of a module-level constant holding one)."""
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def literal(node):
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.split(".")[0] in ROOTS else None

    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in ROOTS:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in ROOTS:
                    out[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value, name = node.value, None
            if isinstance(value, ast.Call) and value.args and isinstance(value.func, ast.Attribute) \
                    and value.func.attr in ("import_module", "get"):
                name = literal(value.args[0])
            elif isinstance(value, ast.Subscript):
                name = literal(value.slice)
            if name:
                out[node.targets[0].id] = name
    return out


def outside_reaches(path, source):
    """Where ``source`` (a test or benchmark at ``path``) reaches a private name of an omni_patches module: imports
    ``_name`` from one, reads ``module._name``, or names it in ``getattr`` / ``setattr`` / ``patch.object`` /
    ``monkeypatch.setattr(module, "_name", ...)`` / ``mock.patch("omni_patches....._name")``. A module whose file
    name starts with ``_`` (``_bootstrap``, the .pth's entry; ``patches/_*.py``, helpers shared by patches) may
    be imported: the names inside a module are what is private."""
    tree = ast.parse(source, str(path))
    where = path.relative_to(REPO)
    aliases, bad = _package_modules(tree), []

    def private_module_file(dotted):  # omni_patches.patches._lora_call names a module, not a private attribute
        top, *rest = dotted.split(".")
        base = ROOTS[top] / Path(*rest) if rest else ROOTS[top]
        return base.with_suffix(".py").exists() or (base / "__init__.py").exists()

    def named(node):  # "omni_patches.engine" for `engine`, `omni_patches.engine`, ... (an alias's attributes)
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = named(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in ROOTS:
            bad += [(node.lineno, f"imports {node.module}.{a.name}") for a in node.names
                    if _private(a.name) and not private_module_file(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and named(node.value) \
                and not private_module_file(f"{named(node.value)}.{node.attr}"):
            bad.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in aliases and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in _NAMED:
            bad.append((node.lineno, f"{node.args[0].id}.{node.args[1].value}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "patch" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            dotted = node.args[0].value
            parts = dotted.split(".")
            if parts[0] in ROOTS and any(_private(p) and not private_module_file(".".join(parts[:i + 1]))
                                                  for i, p in enumerate(parts)):
                bad.append((node.lineno, f"patches {dotted}"))
    return [f"{where}:{line}: {what}" for line, what in sorted(bad)]


def test_tests_and_benchmarks_use_only_public_names():
    bad = [b for path in USERS for b in outside_reaches(path, path.read_text())]
    assert not bad, "\n".join(bad)


def test_the_outside_check_finds_what_it_forbids():
    src = ("import importlib, sys\nfrom omni_patches import engine, log\nfrom omni_patches.engine import _lock\n"
           "from omni_patches.patches import _lora_call as lc\nimport omni_patches.proof as proof\n"
           "MOD = 'omni_patches.patches.moe_ep_parallel_mapping'\n"
           "mod = importlib.import_module(MOD)\nother = sys.modules.get('omni_patches.engine')\n"
           "engine._state\nproof._runs\nmod._x\nother._lock\nlc.FUSED\nlog.get()\n"
           "monkeypatch.setattr(log, '_configured', False)\nmocker.patch.object(engine, 'run')\n"
           "mocker.patch('omni_patches.engine._start')\nmocker.patch('omni_patches.engine.run')\n"
           "own._private\nimport omni_patches.engine\nomni_patches.engine._lock\n"
           "from support import wheels\nwheels._clean\nfrom patches.x.case import _helper\n")
    path = REPO / "tests" / "example.py"
    assert outside_reaches(path, src) == [
        "tests/example.py:3: imports omni_patches.engine._lock", "tests/example.py:9: engine._state",
        "tests/example.py:10: proof._runs", "tests/example.py:11: mod._x", "tests/example.py:12: other._lock",
        "tests/example.py:15: log._configured", "tests/example.py:17: patches omni_patches.engine._start",
        "tests/example.py:21: omni_patches.engine._lock", "tests/example.py:23: wheels._clean",
        "tests/example.py:24: imports patches.x.case._helper"]


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
