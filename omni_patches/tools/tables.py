"""The generated tables: ``patches.toml`` and the README's patch table, written from the patch modules.

A built-in patch module holds its whole record: the docstring (the prose, :mod:`omni_patches.prose`; its first
word is the patch id) and ``TABLE``, a literal dict of the registry's machine keys (``default``, ``requires``,
``fixed_in``, ``targets`` and optionally ``source_builds``, ``needs``; :data:`omni_patches.registry.KEYS`). The
registry the shim reads at start-up stays ``patches.toml`` (stdlib ``tomllib``, no patch module parsed or
imported), and this tool writes it: one ``[[patch]]`` table per module, ``module`` from the file's name. Patches
keep the order they already have in ``patches.toml`` (the order the registry applies them in); a new one goes last.
The README's patch table is then rendered from that registry (:func:`registry_markdown`, also ``omni-patches
list``).

    python -m omni_patches.tools.tables            # exit 1 and say which file differs, writing nothing
    python -m omni_patches.tools.tables --write    # write patches.toml and the README's table

Modules are read as text (``ast``), never imported: the tool runs without torch, vLLM or wrapt.
"""
import argparse
import ast
import json
import os
import re
import sys
import tempfile
import textwrap

from .. import flags, prose, registry

#: The keys a module's TABLE may hold, in the order they are written (id and module come from the module itself).
TABLE_KEYS = ("default", "requires", "fixed_in", "targets", "source_builds", "needs")
HEADER = """\
# omni-patches registry, GENERATED from the patch modules by `python -m omni_patches.tools.tables --write`:
# edit a patch's TABLE (its machine keys) in omni_patches/patches/<name>.py, never this file. Each module's
# docstring -- the record -- is the one source of its prose (summary, upstream links, why, affected versions, how,
# remove when), read from the source when `omni-patches list`, `status` or `doctor` show it. The shim reads this
# file at start-up (stdlib tomllib only). Order = application order; a new patch goes last.
# Keys: registry.KEYS; which goes where: CONTRIBUTING.md "How to add a patch". An overlay (OMNI_PATCHES_CONFIG)
# writes its own tables by hand (docs/how-it-works.md "Your own patch").
"""
_MARKERS = re.compile(r"(<!-- patch-table:start[^>]*-->\n)(.*?)(\n<!-- patch-table:end -->)", re.S)


class TableError(ValueError):
    """A patch module whose record or TABLE cannot make a registry entry (the message names the file)."""


def module_entry(path, package="omni_patches.patches"):
    """``(table, record)``: the ``[[patch]]`` table (a dict, ``id`` first) that the module at ``path`` declares, and
    the fields of its record (:func:`omni_patches.prose.parse`), both read from the file."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    name = os.path.splitext(os.path.basename(path))[0]
    doc = prose.docstring(text) or ""
    pid = doc.split("\n", 1)[0].partition(":")[0].strip()
    rec = prose.parse(pid, doc) if registry.is_id(pid) and prose.opens_record(pid, text) else None
    if rec is None:
        raise TableError(f"{path}: the docstring must open with its record, '<patch-id>: <summary>'")
    found = [node for node in ast.parse(text, path).body if isinstance(node, ast.Assign)
             and [getattr(t, "id", None) for t in node.targets] == ["TABLE"]]
    if len(found) != 1:
        raise TableError(f"{path}: needs exactly one module-level TABLE = {{...}} (its machine keys), found "
                         f"{len(found)}")
    try:
        table = ast.literal_eval(found[0].value)
    except ValueError as exc:
        raise TableError(f"{path}:{found[0].lineno}: TABLE must be a literal dict: {exc}") from None
    if not isinstance(table, dict):
        raise TableError(f"{path}:{found[0].lineno}: TABLE must be a dict, got {type(table).__name__}")
    unknown = sorted(set(table) - set(TABLE_KEYS))
    if unknown:
        raise TableError(f"{path}: TABLE has key(s) {unknown}; it may hold {', '.join(TABLE_KEYS)}")
    return {"id": pid, **{k: table[k] for k in TABLE_KEYS if k in table}, "module": f"{package}.{name}"}, rec


def module_entries(patches_dir):
    """``[(table, record)]`` of every patch module under ``patches_dir`` (files not starting with ``_``), by file
    name."""
    names = sorted(n for n in os.listdir(patches_dir) if n.endswith(".py") and not n.startswith("_"))
    return [module_entry(os.path.join(patches_dir, n)) for n in names]


def _value(value):
    """TOML for the values a table holds: a JSON string is a TOML basic string, and so are its escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TableError(f"cannot write {value!r} ({type(value).__name__}) as a registry value")


def shared_modules(patches_dir):
    """The file names under ``patches_dir`` that are not patches: code patches share (``_*.py``, the package
    ``__init__`` aside)."""
    return sorted(n for n in os.listdir(patches_dir) if n.startswith("_") and n.endswith(".py") and n != "__init__.py")


def render_toml(entries, order=(), shared=()):
    """The text of ``patches.toml``: ``entries`` in ``order`` (ids), the ones not in it last, by id; ``shared``
    (:func:`shared_modules`) named in the header."""
    rank = {pid: n for n, pid in enumerate(order)}
    ordered = sorted(entries, key=lambda e: (rank.get(e["id"], len(rank)), e["id"]))
    blocks = ["\n".join(["[[patch]]", *(f"{k} = {_value(v)}" for k, v in e.items())]) for e in ordered]
    note = "Code patches share, not patches (each module's docstring says by which): " + ", ".join(
        f"omni_patches/patches/{name}" for name in shared) + "."
    header = HEADER + "".join(f"# {line}\n" for line in textwrap.wrap(note, 114)) if shared else HEADER
    return header + "\n" + "\n\n".join(blocks) + "\n"


def declared_order(path):
    """The ids of ``path`` (a registry file) in their order; none where it is missing or unreadable."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            return [e.get("id") for e in tomllib.load(fh).get("patch", []) if isinstance(e, dict)]
    except (OSError, ValueError):
        return []


def registry_markdown(reg, summaries=None):
    """The README's patch table, generated from the registry ``reg``; ``summaries`` (id -> text) where the records
    are read from other files than the modules the registry finds."""
    summaries = summaries or {}
    rows = ["| patch | switch (default) | applies to | fixed upstream in | what it fixes |",
            "|---|---|---|---|---|"]
    for s in reg.specs.values():
        applies = "<br>".join(f"`{d} {v}`" for d, v in s.requires.items())
        fixed = "<br>".join(f"`{d} {v}`" for d, v in s.fixed_in.items()) or "—"
        default = "on" if s.default else "off"
        summary = summaries.get(s.id, s.summary)
        rows.append(f"| `{s.id}` | `{flags.env_name(s.id)}` ({default}) | {applies} | {fixed} | {summary} |")
    return "\n".join(rows)


def generated(root):
    """``{path: text}``: what ``patches.toml`` and ``README.md`` under the checkout ``root`` must hold."""
    toml_path, readme_path = os.path.join(root, "patches.toml"), os.path.join(root, "README.md")
    patches_dir = os.path.join(root, "omni_patches", "patches")
    found = module_entries(patches_dir)
    toml_text = render_toml([entry for entry, _ in found], declared_order(toml_path), shared_modules(patches_dir))
    with tempfile.TemporaryDirectory() as tmp:  # the README table is rendered from the registry just generated
        fresh = os.path.join(tmp, "patches.toml")
        with open(fresh, "w", encoding="utf-8") as fh:
            fh.write(toml_text)
        reg = registry.load([fresh])
        bad = reg.errors + [s.error for s in reg.specs.values() if s.error]
        if bad:
            raise TableError("the generated registry is not valid: " + "; ".join(bad))
        table = registry_markdown(reg, {entry["id"]: rec["summary"] for entry, rec in found})
    with open(readme_path, encoding="utf-8") as fh:
        readme = fh.read()
    if not _MARKERS.search(readme):
        raise TableError(f"{readme_path}: lacks the patch-table markers")
    readme = _MARKERS.sub(lambda m: m.group(1) + table + m.group(3), readme, count=1)
    return {toml_path: toml_text, readme_path: readme}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m omni_patches.tools.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write the files that differ")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), help="the checkout (default: this package's)")
    args = parser.parse_args(argv)
    try:
        want = generated(args.root)
    except (TableError, OSError, SyntaxError) as exc:
        print(f"tables: {exc}", file=sys.stderr)
        return 2
    stale = []
    for path, text in want.items():
        try:
            with open(path, encoding="utf-8") as fh:
                if fh.read() == text:
                    continue
        except OSError:
            pass  # no such file yet: written
        stale.append(path)
        if args.write:  # whole or not at all: a reader never sees half a registry
            with open(path + ".part", "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(path + ".part", path)
    for path in stale:
        print(f"{'wrote' if args.write else 'out of date'}: {os.path.relpath(path, args.root)}")
    if not stale:
        print("tables: patches.toml and the README's patch table are up to date")
    return 0 if args.write or not stale else 1


if __name__ == "__main__":
    sys.exit(main())
