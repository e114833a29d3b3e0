"""The package's import graph, built from its source: no cycle among its modules, and every import goes from a
higher layer to a lower one (or within one) unless its line says why (``# upward: <reason>``, on the import or
the line above).

Every import counts, also one inside a function: a lazy import keeps start-up cheap, but it is still a
dependency, and a cycle through it is one more thing each side must know about the other.
"""
import ast
from pathlib import Path

import omni_patches

PACKAGE = Path(omni_patches.__file__).parent
ROOT = "omni_patches"
MARKER = "# upward:"

# Lowest first. A module may import from its own layer and the layers before it (an import from a later layer
# needs its reason on the line: MARKER); "x.*" stands for every module of the subpackage x. Every module of the
# package has exactly one layer (a new module must be placed here).
LAYERS = [
    # words and switches, stdlib only (the start-up path lives here: flags, registry)
    ("words", ["_version", "flags", "states", "prose", "registry", "log", "records"]),
    # what is installed, whether a patch may apply, how a target is changed (packaging, wrapt)
    ("gates", ["versions", "gates", "envcheck", "wrapping"]),
    # a patch's run-time record and context; the process record (told what to read, never reading the engine)
    ("records", ["runs", "context", "proof"]),
    # the patches see the shim through ctx (and the logger, versions): never the engine
    ("patches", ["patches", "patches.*"]),
    # the lifecycle's parts, each handed the engine's activation state
    ("lifecycle parts", ["strict", "needs", "staleness", "undo", "applying", "starting"]),
    # the lifecycle: activation, its state, the public calls on it
    ("engine", ["engine"]),
    # readers of the engine and of release files: status / doctor, the fleet view, the offline tools
    ("views", ["reports", "fleet", "tools", "tools.*"]),
    # what a user or an interpreter calls: the package's front, the .pth, vLLM's plugin, the CLI, the harness
    ("entry points", ["", "__main__", "_bootstrap", "plugin", "cli", "testing", "testing.*"]),
]


def layer_of(name):
    """The index in :data:`LAYERS` of the module ``name`` (dotted, ``omni_patches`` for the package), or None."""
    short = name[len(ROOT) + 1:] if name != ROOT else ""
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if short == member or (member.endswith(".*") and short.startswith(member[:-1])):
                return index
    return None


def where(path):
    """``path`` from the package's own directory on (``omni_patches/engine.py``): what messages name."""
    parts = path.parts
    return Path(*parts[len(parts) - 1 - parts[::-1].index(ROOT):])


def module_name(path):
    parts = list(where(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package=PACKAGE):
    """``{dotted name: path}`` of every module of the package (a package's ``__init__`` under its own name)."""
    return {module_name(p): p for p in sorted(package.rglob("*.py")) if "__pycache__" not in p.parts}


def _resolve(name, mods):
    """``name`` if it is a module of the package, else the nearest enclosing one (``omni_patches.x.attr`` -> x)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(name, path, mods, source=None):
    """``[(imported module, line number)]`` for every import of a package module in the module ``name``: at
    module level or inside a function; ``from . import x`` counts as an import of module ``x`` when there is
    one (else of the package that holds the name)."""
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == ROOT or target.startswith(ROOT + "."):
                resolved = _resolve(target, mods)
                if resolved is not None and resolved != name:
                    out.append((resolved, node.lineno))
    return out


def graph(mods=None, sources=None):
    """``{module: {imported module: first line}}`` of the package (``sources``: texts instead of the files)."""
    mods = mods if mods is not None else modules()
    out = {}
    for name, path in mods.items():
        edges = out.setdefault(name, {})
        for target, line in imports(name, path, mods, (sources or {}).get(name)):
            edges.setdefault(target, line)
    return out


def upward(mods=None, sources=None):
    """Every import from a lower layer to a higher one whose line (or the line above) does not say why
    (:data:`MARKER` followed by a reason)."""
    mods = mods if mods is not None else modules()
    bad = []
    for name, path in mods.items():
        text = (sources or {}).get(name)
        text = text if text is not None else path.read_text()
        lines = text.splitlines()
        for target, line in imports(name, path, mods, text):
            low, high = layer_of(name), layer_of(target)
            if low is None or high is None or high <= low:
                continue
            said = [lines[n - 1] for n in (line, line - 1) if 0 < n <= len(lines)]
            if not any(MARKER in ln and ln.split(MARKER, 1)[1].strip() for ln in said):
                bad.append(f"{where(path)}:{line}: {_short(name)} ({LAYERS[low][0]}) imports "
                           f"{_short(target)} ({LAYERS[high][0]}), a later layer: move the code, pass it down, or "
                           f"say why on the line ({MARKER} <reason>)")
    return bad


def _short(name):
    return name[len(ROOT) + 1:] or ROOT


def cycles(g):
    """The import cycles of ``g``: for each strongly connected component, the shortest cycle through each of its
    modules (``[a, b, ..., a]``, each cycle once), sorted."""
    index, low, stack, on_stack, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # the shortest cycle through each of its modules, each cycle once
        for start in sorted(comp):
            cycle = _path_back(g, comp, start)[:-1]
            turn = cycle.index(min(cycle))
            cycle = cycle[turn:] + cycle[:turn] + [min(cycle)]
            if cycle not in out:
                out.append(cycle)
    return sorted(out)


def _path_back(g, comp, start):
    """A shortest cycle from ``start`` back to itself inside ``comp`` (breadth first)."""
    prev, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w not in comp:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]  # pragma: no cover - a component always holds a cycle


def describe(cycle, g, mods):
    steps = [f"{_short(a)} -> {_short(b)} ({where(mods[a])}:{g[a][b]})"
             for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(_short(m) for m in cycle) + "\n    " + "\n    ".join(steps)


def test_the_package_has_no_import_cycle():
    mods = modules()
    g = graph(mods)
    found = cycles(g)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(describe(c, g, mods) for c in found)


def test_every_module_has_a_layer():
    unplaced = [name for name in modules() if layer_of(name) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    placed = [m for _, members in LAYERS for m in members]
    assert len(placed) == len(set(placed)), "a module in two layers"


def test_imports_go_down_the_layers():
    bad = upward()
    assert not bad, "\n".join(bad)


# -- the checks themselves, on made-up modules -----------------------------------------------------------------
def _fake(tmp_path, files):
    """A package ``omni_patches`` under ``tmp_path`` holding ``files`` (``{relative path: text}``)."""
    for rel, text in {"__init__.py": "", **files}.items():
        path = tmp_path / ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(tmp_path / ROOT)


def test_the_graph_counts_every_kind_of_import(tmp_path):
    mods = _fake(tmp_path, {
        "flags.py": "",
        "log.py": "def f():\n    from . import flags\n",  # inside a function
        "engine.py": "import omni_patches.log\nfrom omni_patches.flags import parse\nfrom . import __version__\n",
        "tools/__init__.py": "", "tools/audit.py": "from .. import engine\nfrom . import index\n",
        "tools/index.py": "import os\n",
    })
    g = graph(mods)
    assert g["omni_patches.log"] == {"omni_patches.flags": 2}
    assert g["omni_patches.engine"] == {"omni_patches.log": 1, "omni_patches.flags": 2, "omni_patches": 3}
    assert g["omni_patches.tools.audit"] == {"omni_patches.engine": 1, "omni_patches.tools.index": 2}
    assert g["omni_patches.tools.index"] == {}


def test_a_cycle_is_found_with_its_lines(tmp_path):
    mods = _fake(tmp_path, {
        "context.py": "def f():\n    from . import runs\n",
        "runs.py": "from . import proof\n",
        "proof.py": "from .engine import snapshot\n",
        "engine.py": "from .context import PatchContext\nfrom . import reports\n",
        "reports.py": "from . import engine\n",
    })
    g = graph(mods)
    found = cycles(g)
    assert found == [["omni_patches.context", "omni_patches.runs", "omni_patches.proof", "omni_patches.engine",
                      "omni_patches.context"],
                     ["omni_patches.engine", "omni_patches.reports", "omni_patches.engine"]]
    assert describe(found[1], g, mods).splitlines()[1:] == [
        "    engine -> reports (omni_patches/engine.py:2)", "    reports -> engine (omni_patches/reports.py:1)"]


def test_an_upward_import_needs_its_reason(tmp_path):
    sources = {"omni_patches.flags": "from . import engine\n",
               "omni_patches.log": "# upward: the reason, on the line above\nfrom . import engine\n",
               "omni_patches.states": "from . import engine  # upward:\n"}  # a marker without a reason
    mods = _fake(tmp_path, {"engine.py": "", **{f"{m.rpartition('.')[2]}.py": t for m, t in sources.items()}})
    assert [b.partition(" (")[0] for b in upward(mods)] == ["omni_patches/flags.py:1: flags",
                                                           "omni_patches/states.py:1: states"]
