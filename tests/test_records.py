"""One record per patch: the module docstring is the source of its prose, its TABLE the machine keys (generated
into patches.toml: test_tables.py), and docs/patches.md only what the record does not say."""
import importlib
import json
import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest

import omni_patches
from omni_patches import cli, engine, prose, registry
from support.fakes import entry

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


def test_patches_toml_holds_only_machine_keys():
    """The prose is the record's: not one prose key in the shipped registry (an overlay may give them only for a
    module without a record)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    with open(registry.builtin_path(), "rb") as fh:
        entries = tomllib.load(fh)["patch"]
    for e in entries:
        assert not set(e) & set(prose.KEYS), (e["id"], sorted(set(e) & set(prose.KEYS)))
    assert all(not s.toml_prose for s in SPECS.values())


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_record_is_read_from_the_source_as_python_reads_it(pid):
    """The registry reads the docstring from the source, without importing the module: the same text as
    ``__doc__``."""
    spec = SPECS[pid]
    text = prose.source(prose.find(spec.module))
    assert prose.docstring(text) == importlib.import_module(spec.module).__doc__
    assert prose.opens_record(pid, text)


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_record_mirrors_registry(pid):
    """The Affected line states the registry's ``requires`` / ``fixed_in`` ranges: the machine keys and the prose
    cannot drift apart."""
    spec = SPECS[pid]
    rec = prose.record(spec)
    assert rec is not None, f"{spec.module} must open with '{pid}: <summary>'"
    for key in ("why", "affected", "how", "remove_when"):
        assert rec[key], f"{spec.module}: record has no {key!r} field"
    assert rec["upstream"], f"{spec.module}: the record's Upstream field names no URL"
    ranges = "; ".join(f"{dist} {specifier}" for dist, specifier in spec.requires.items())
    assert rec["affected"].startswith(ranges), f"{spec.module}: Affected must open with {ranges!r}: {rec['affected']!r}"
    stated = dict(re.findall(r"fixed upstream in (\S+) (\d[^\s,;)]*[^\s,;).])", rec["affected"]))
    assert stated == spec.fixed_in, f"{spec.module}: Affected says fixed upstream in {stated}, patches.toml {spec.fixed_in}"


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_record_fits_a_screenful(pid):
    """The record is read by an operator: its fields in order, at most MAX_RECORD_LINES lines as written in the
    file (opening and closing quotes included); measurements and test narrative live in docs/patches.md."""
    spec = SPECS[pid]
    doc = prose.docstring(prose.source(prose.find(spec.module))) or ""
    lines = doc.count("\n") + 1
    assert lines <= MAX_RECORD_LINES, f"{spec.module}: record is {lines} lines (at most {MAX_RECORD_LINES})"
    starts = [next((i for i, line in enumerate(doc.splitlines()) if line.startswith(label)), -1) for label in FIELDS]
    assert -1 not in starts and starts == sorted(starts), f"{spec.module}: fields missing or out of order {starts}"
    anchor = f"## `{pid}`"
    if "docs/patches.md" in doc:  # a long form is optional; a record that points to one needs it there
        assert anchor in DOCS.read_text(), f"{spec.module}: its record points to docs/patches.md, which lacks {anchor!r}"


# -- docs/patches.md keeps only what is not in the record ----------------------------------------------------------
GRAM = 4  # words per shingle: long enough that shared technical terms are not a restatement
SENTENCE_SHARE = 0.5  # a sentence with half its shingles in the record restates it
WHY_SHARE = 0.2  # a section holding a fifth of the Why field's shingles retells it, sentence by sentence or not


def _words(text):
    """Lower-case words of markdown or RST prose: markup, punctuation and line breaks do not count."""
    text = re.sub(r"https?://\S+", " ", text.lower())
    return [w.strip(".-") for w in re.findall(r"[\w.·+<>=≥-]+", text) if w.strip(".-")]


def _grams(words):
    return {tuple(words[i:i + GRAM]) for i in range(len(words) - GRAM + 1)}


def _sections(text):
    parts = re.split(r"^## `([a-z0-9-]+)`[ \t]*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _range_patterns(spec):
    """How an affected range is written: the specifier, ``dist ≥X``, ``dist X–Y``, ``fixed (upstream) in [dist] V``."""
    for dist, specifier in spec.requires.items():
        yield re.escape(specifier.replace(" ", ""))
        name = r"\b" + re.escape(dist) + r"(?![\w-])"
        for lower in re.findall(r">=\s*([^,\s]+)", specifier):
            yield name + r"\s*(?:≥|>=)\s*" + re.escape(lower)
            yield name + r"\s+" + re.escape(lower) + r"\s*(?:–|—|-|to)\s*\d"
    for dist, version in spec.fixed_in.items():
        yield r"fixed (?:upstream )?in (?:" + re.escape(dist) + r" )?" + re.escape(version) + r"(?![\w.])"


def restatements(spec, section, rec=None):
    """What ``section`` (its text in docs/patches.md) repeats of ``spec``'s record: [] when nothing."""
    rec = rec or spec.prose()
    found = [f"upstream link {u}" for u in rec["upstream"] if u in section]
    flat = re.sub(r"\s+", "", section)  # a specifier written with spaces
    found += [f"affected range ({m.group(0)!r})" for p in _range_patterns(spec)
              for m in [re.search(p, section, re.I) or re.search(p, flat, re.I)] if m]
    words = " ".join(_words(section))
    found += [f"its {key}: {rec[key]!r}" for key in ("summary", "remove_when") if " ".join(_words(rec[key])) in words]
    why = _grams(_words(rec["why"]))
    share = len(why & _grams(_words(section))) / max(1, len(why))
    if share >= WHY_SHARE:
        found.append(f"{share:.0%} of its Why field")
    record = _grams(_words(" ".join(rec[k] for k in ("summary", "why", "affected", "how", "remove_when"))))
    for sentence in re.split(r"(?<=[.:;!?)])\s+(?=[A-Z*`(])|\n\s*\n|\n- ", section):
        grams = _grams(_words(sentence))
        if len(grams) >= 3 and len(grams & record) / len(grams) >= SENTENCE_SHARE:
            found.append(f"the sentence {' '.join(sentence.split())[:100]!r}")
    return found


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_docs_section_does_not_restate_the_record(pid):
    """docs/patches.md keeps how a patch is tested, findings and measurements; what it fixes, its upstream links,
    affected range, how and when to remove it are the record's (shown by `omni-patches list --json`). A section is
    optional (CONTRIBUTING, "How to add a patch"): a patch without one has nothing to restate."""
    section = _sections(DOCS.read_text()).get(pid)
    if section is None:
        pytest.skip(f"docs/patches.md has no section for {pid} (optional)")
    found = restatements(SPECS[pid], section)
    assert not found, f"docs/patches.md, section `{pid}`, restates its record ({SPECS[pid].module}): {found}"


def _reflowed(text, width=70):
    """The record's text as a doc writer would paste it: markdown code spans, other line breaks."""
    return textwrap.fill(text.replace("``", "`"), width)


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_the_restatement_check_sees_pasted_record_text(pid):
    """The check is not a string equality: reflowed, re-marked-up record text is caught, field by field."""
    spec = SPECS[pid]
    rec = spec.prose()
    section = _sections(DOCS.read_text()).get(pid, "")  # an optional section: the check reads pasted text alone
    dist, specifier = next(iter(spec.requires.items()))
    lower = re.search(r">=\s*([^,\s]+)", specifier).group(1)
    pasted = {
        "why": _reflowed(rec["why"]),
        "remove when": f"Remove it when {_reflowed(rec['remove_when'])}",
        "affected line": f"*{dist} ≥{lower}.*",
        "affected range": f"*{dist} {lower}–0.99.x, on every platform.*",
        "specifier": f"Affected: `{dist} {specifier}`.",
        "link": f"Upstream: <{rec['upstream'][0]}>.",
        "summary": f"The patch will {rec['summary']}.",
    }
    for what, text in pasted.items():
        assert restatements(spec, section + "\n" + text + "\n"), f"{what} pasted into `{pid}` went unseen: {text!r}"


# -- the reader: docstrings as the compiler sees them, without importing -------------------------------------------
READER_CASES = {
    "plain": '"""p-x: fix it\n\nWhy: because\n"""\nimport os\n',
    "comments and coding first": '#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n\n"""p-x: fix it"""  # tail\n',
    "raw, single quotes": "r'''p-x: fix \\d it'''\n",
    "escaped quotes": '"""p-x: say \\"""hi\\""" "" x"""\n',
    "single-quoted": '"p-x: fix it"\n',
    "parenthesised": '("""p-x: fix it""")\n',
    "concatenated": '"""p-x: fix """ """it"""\n',
    "continued first line": '"""\\\np-x: fix it"""\n',
    "code after it": '"""p-x: fix it"""; import os\n',
    "future import first": 'from __future__ import annotations\n"""p-x: fix it"""\n',
    "no docstring": "import os\n",
    "bytes": 'b"""p-x: fix it"""\n',
    "f-string": 'f"""p-x: fix it"""\n',
    "empty summary": '"""p-x:\n\nWhy: because"""\n',
    "other id": '"""p-y: fix it"""\n',
    "indented id": '""" p-x: fix it"""\n',
    "quotes only after the id": '"""p-x: """\n',
    "crlf": '"""p-x: fix it\r\n\r\nWhy: because\r\n"""\r\n',
    "empty file": "",
}


@pytest.mark.parametrize("name", sorted(READER_CASES))
def test_the_reader_agrees_with_the_compiler(name):
    import ast

    text = READER_CASES[name]
    expected = ast.get_docstring(ast.parse(text), clean=False)
    assert prose.docstring(text) == expected
    assert prose.opens_record("p-x", text) == (prose.parse("p-x", expected) is not None)


def test_parse_reads_every_field():
    doc = textwrap.dedent('''\
        p-x: fix the thing

        Why:         it breaks
                     badly (``x``)
        Upstream:    https://example.invalid/pr/1 (and https://example.invalid/issues/2; see
                     https://example.invalid/pr/1.)
        Affected:    dist >=1.0,<2.0; fixed upstream in dist 2.0
        How:         wraps it
        Remove when: dist 2.0 is the oldest supported

        Not part of the record.
        ''')
    assert prose.parse("p-x", doc) == {
        "summary": "fix the thing", "why": "it breaks badly (``x``)",
        "upstream": ["https://example.invalid/pr/1", "https://example.invalid/issues/2"],
        "affected": "dist >=1.0,<2.0; fixed upstream in dist 2.0", "how": "wraps it",
        "remove_when": "dist 2.0 is the oldest supported"}
    assert prose.parse("p-y", doc) is None and prose.parse("p-x", "p-x:\n") is None


# -- read lazily: start-up, gating and applying never parse the prose ---------------------------------------------
def test_the_registry_reads_no_prose_until_asked(shim, monkeypatch):
    shim.omni()
    _on(shim, entry())
    monkeypatch.setattr(prose, "of", lambda spec: pytest.fail(f"prose read for {spec.id} while serving"))
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6
    assert engine.snapshot().runs["fake-double"].state == "applied"


# -- overlays: the record when the module has one, else the table's prose -------------------------------------------
RECORDED = '''"""fake-double: doubles compute, from a record

Why:         the fake target needs it
Upstream:    https://example.invalid/pr/7
Affected:    fake-omni >=0.27.0rc1,<0.30.0rc1; fixed upstream in fake-omni 0.30.0rc1
How:         wraps compute
Remove when: never
"""
from fakepatches.double import apply, check  # noqa: F401
'''


def _on(shim, *entries, **env):
    shim.registry(*entries)
    shim.env(OMNI_PATCHES="1", **env)
    return omni_patches.activate()


def _machine(**over):
    return {k: v for k, v in entry(**over).items() if k not in prose.KEYS}


def _listed(capsys):
    capsys.readouterr()  # what came before (the activation's own log lines) is not `list`'s
    code = cli.main(["list", "--json"])
    out = capsys.readouterr()
    return code, {p["id"]: p for p in json.loads(out.out)}, out.err


def test_an_overlay_module_with_a_record_gives_its_prose(shim, capsys):
    shim.omni()
    (shim.site / "recorded_fix.py").write_text(RECORDED)
    _on(shim, _machine(module="recorded_fix"))
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6 and shim.status()["fake-double"].state == "applied"
    assert "recorded_fix" in sys.modules  # applied, so imported by now; `list` alone would not import it
    code, listed, err = _listed(capsys)
    assert code == 0 and not err
    assert {k: listed["fake-double"][k] for k in prose.KEYS} == {
        "summary": "doubles compute, from a record", "upstream": ["https://example.invalid/pr/7"],
        "why": "the fake target needs it", "remove_when": "never"}
    assert set(listed["fake-double"]) == {*registry.KEYS, "env"}  # the same fields as before
    assert shim.status()["fake-double"].summary == "doubles compute, from a record"


def test_list_reads_the_record_without_importing_the_module(shim, capsys):
    (shim.site / "recorded_fix.py").write_text(RECORDED + "raise SystemExit('imported')\n")
    shim.registry(_machine(module="recorded_fix"))
    code, listed, _ = _listed(capsys)
    assert code == 0 and listed["fake-double"]["summary"] == "doubles compute, from a record"
    assert "recorded_fix" not in sys.modules


def test_an_overlay_module_without_a_record_gives_its_prose_in_its_table(shim, capsys):
    shim.omni()
    _on(shim, entry())  # fakepatches.double: a plain docstring, the prose in the table
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6 and shim.status()["fake-double"].state == "applied"
    code, listed, _ = _listed(capsys)
    assert code == 0 and listed["fake-double"]["summary"] == "doubles fakeomni.loader.compute"
    assert listed["fake-double"]["upstream"] == ["https://example.invalid/pr/1"]
    assert (listed["fake-double"]["why"], listed["fake-double"]["remove_when"]) == ("test", "never")


def test_no_record_and_no_summary_is_a_registry_error(shim, capsys, logs):
    """The host keeps running unpatched; the reason is logged once and shown by the CLI; strict mode raises."""
    shim.omni()
    overlay = shim.registry(_machine(), name="overlay.toml")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 3  # unpatched, and the import went on
    reason = (f"{overlay}: patch 'fake-double': module 'fakepatches.double' has no record (a docstring opening "
              "'fake-double: <summary>'")
    st = shim.status()["fake-double"]
    assert st.state == "failed" and reason in st.reason, st.reason
    assert sum(reason in m for m in logs.messages(logging.ERROR)) == 1
    cli.main(["status"])
    assert reason in capsys.readouterr().out
    code, listed, err = _listed(capsys)
    assert code == 1 and f"registry error: {reason}" in err and listed["fake-double"]["summary"] == ""
    engine.deactivate()
    for mod in [m for m in sys.modules if m.partition(".")[0] == "fakeomni"]:
        del sys.modules[mod]
    shim.env(OMNI_PATCHES_STRICT="1")
    omni_patches.activate()
    with pytest.raises(engine.StrictModeError, match="has no record") as err:
        import fakeomni.loader  # noqa: F401, F811
    assert reason in str(err.value)


def test_a_record_and_prose_in_the_table_is_a_registry_error(shim, capsys):
    """Two sources of one text drift apart: the entry is invalid, and the message names the file and the keys."""
    shim.omni()
    (shim.site / "recorded_fix.py").write_text(RECORDED)
    overlay = shim.registry(entry(module="recorded_fix"), name="overlay.toml")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 3
    st = shim.status()["fake-double"]
    assert st.state == "failed", st
    assert (f"{overlay}: patch 'fake-double': key(s) 'summary', 'upstream', 'why', 'remove_when': module "
            "'recorded_fix' opens with its record") in st.reason
    code, _, err = _listed(capsys)
    assert code == 1 and "opens with its record" in err


def test_an_overlay_may_change_a_shipped_entry_without_prose(shim):
    """An overlay that only switches a recorded patch off gives no prose, and the record stays the source."""
    shim.omni()
    (shim.site / "recorded_fix.py").write_text(RECORDED)
    shim.registry(_machine(module="recorded_fix"))
    overlay = shim.registry({"id": "fake-double", "default": False}, name="overlay.toml")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    st = shim.status()["fake-double"]
    assert st.state == "skipped:disabled" and st.summary == "doubles compute, from a record"


def test_a_sourceless_install_applies_and_lists_its_record(shim, capsys):
    """An image that ships bytecode only (``compileall -b``, the ``.py`` removed): no source to read the record
    from. The patch still applies (a missing source is no reason to run the host unpatched) and ``list`` reads the
    record from the compiled module's docstring."""
    import py_compile

    shim.omni()
    src = shim.site / "recorded_fix.py"
    src.write_text(RECORDED)
    py_compile.compile(str(src), cfile=str(shim.site / "recorded_fix.pyc"), doraise=True)
    src.unlink()
    _on(shim, _machine(module="recorded_fix"))
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6 and shim.status()["fake-double"].state == "applied"
    code, listed, err = _listed(capsys)
    assert code == 0 and not err and listed["fake-double"]["summary"] == "doubles compute, from a record"
