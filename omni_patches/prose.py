"""A patch's prose -- summary, upstream links, why, remove-when -- read from its record, the module docstring.

The record (format: :mod:`omni_patches.patches`) is the one source of a patch's prose; ``patches.toml`` holds only
the machine keys (generated from the module's ``TABLE``, :mod:`omni_patches.tools.tables`). The prose is read from
the module's *source*, never by importing it, and only when something asks for it
(:meth:`omni_patches.registry.PatchSpec.prose`: ``omni-patches list``, ``status``, ``doctor``, the README table): a
serving process does not parse it. Where the gates run (the first import of a target package, ``doctor``, ``audit``)
:func:`problem` checks that the record is there, from the first bytes of the file, and makes a patch without prose
``failed`` with the reason, like any invalid entry.

An overlay's patch (``OMNI_PATCHES_CONFIG``) whose module has no record gives its prose in its ``[[patch]]``
table instead: ``summary`` (required then), ``upstream``, ``why``, ``remove_when``. A module with a record takes
none of them from the table (two sources of one text drift apart): that entry is invalid.
"""
import re

# Record labels, in their order, and the key each field is read into.
FIELDS = (("Why:", "why"), ("Upstream:", "upstream"), ("Affected:", "affected"), ("How:", "how"),
          ("Remove when:", "remove_when"))
# The prose a registry entry exposes (PatchSpec attributes, ``list --json``), and the only prose an overlay's
# table may give.
KEYS = ("summary", "upstream", "why", "remove_when")

_URL = re.compile(r"https?://[^\s<>()\[\]\"'`]+")
# Blank and comment lines before the first statement, then what starts it.
_LEAD = re.compile(r"\ufeff?(?:[ \t\f]*(?:#[^\r\n]*)?(?:\r\n|\r|\n))*[ \t\f]*")
_TRIPLE = {q: re.compile("(?P<lit>[rRuU]?" + q + "(?:[^" + q[0] + "\\\\]|\\\\.|" + q[0] + "(?!" + q[0] * 2 + "))*" + q +
                         r")[ \t\f]*(?:#[^\r\n]*)?(?:\r\n|\r|\n|\Z)", re.S)
           for q in ('"""', "'''")}
_TRAILER = re.compile(r"[ \t\f]*(?:#[^\r\n]*)?(?:\r\n|\r|\n|\Z)")
_STRING_START = re.compile(r"[rRuU]?['\"]")
_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.M)


def source(found):
    """The source text of the module ``found`` (an ``importlib`` ModuleSpec), or None where there is none to read
    (a sourceless or built-in module)."""
    origin, loader = getattr(found, "origin", None), getattr(found, "loader", None)
    if not origin or not origin.endswith(".py") or not hasattr(loader, "get_data"):
        return None
    try:
        raw = loader.get_data(origin)  # a file, or a member of a zip archive (zipimport)
    except OSError:
        return None
    cookie = _COOKIE.search(b"\n".join(raw.split(b"\n", 2)[:2]))
    if cookie and cookie.group(1).lower().replace(b"_", b"-") not in (b"utf-8", b"utf8", b"utf-8-sig"):
        import importlib.util

        return importlib.util.decode_source(raw)
    return raw.decode("utf-8-sig", "replace").replace("\r\n", "\n").replace("\r", "\n")


def _literal(text):
    """``(literal, exact)``: the module's first statement when it is a triple-quoted string alone on its lines,
    else ``(None, exact)``; ``exact`` False means only a full parse can tell (an unusual opening)."""
    start = _LEAD.match(text).end()
    if not _STRING_START.match(text, start):
        return None, text[start:start + 1] not in ("(", "\\")  # a name, keyword, decorator...: no docstring
    opening = 4 if text[start] in "rRuU" else 3
    quote = text[start + opening - 3:start + opening]
    if quote not in _TRIPLE:
        return None, False
    end = text.find(quote, start + opening)
    if end >= 0 and "\\" not in text[start:end]:  # no escapes: the first closing quote ends it (str.find is fast)
        m = _TRAILER.match(text, end + 3)
        return (text[start:end + 3], True) if m else (None, False)
    m = _TRIPLE[quote].match(text, start)
    return (m.group("lit"), True) if m else (None, False)


def docstring(text):
    """The module docstring of source ``text`` exactly as the compiler sees it (unindented, ``clean=False``), or
    None. Parses only the opening string literal with ``ast`` where that decides it, else the whole module."""
    import ast

    lit, exact = _literal(text)
    if lit is not None:
        return ast.literal_eval(lit)
    if exact:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    return ast.get_docstring(tree, clean=False)


def opens_record(pid, text):
    """Whether source ``text`` opens with ``pid``'s record (``"<pid>: <summary>``): a look at the first bytes, no
    ``ast``, as long as the docstring opens plainly; else the exact reading of :func:`docstring`."""
    lit, exact = _literal(text)
    if lit is not None:
        body = lit.lstrip("rRuU")[3:]
        first = body.split("\n", 1)[0]
        if "\\" not in first:
            return first.startswith(pid + ":") and bool(first[len(pid) + 1:].strip(" \t\"'"))
    elif exact:
        return False
    return parse(pid, docstring(text)) is not None


def parse(pid, doc):
    """The fields of ``pid``'s record ``doc``: ``summary``, ``upstream`` (the URLs of its Upstream field, in
    order), ``why``, ``affected``, ``how``, ``remove_when`` (each field's text on one line); None when ``doc``
    is not a record (it does not open with ``<pid>: <summary>``)."""
    lines = (doc or "").expandtabs().split("\n")
    head, _, summary = lines[0].partition(":")
    summary = summary.strip()
    if head != pid or not summary:  # the id opens the docstring, as opens_record() sees it
        return None
    body = [ln for ln in lines[1:] if ln.strip()]
    indent = min((len(ln) - len(ln.lstrip()) for ln in body), default=0)
    fields, current = {key: [] for _, key in FIELDS}, None
    for line in (ln[indent:] for ln in lines[1:]):
        label = next((lab for lab, _ in FIELDS if line.startswith(lab)), None)
        if label is not None:
            current = dict(FIELDS)[label]
            line = line[len(label):]
        elif not line.strip() or not line[:1].isspace():
            current = None  # a blank line or unindented text ends a field: anything after is not the record's
        if current is not None and line.strip():
            fields[current].append(line.strip())
    out = {key: " ".join(parts) for key, parts in fields.items()}
    out["upstream"] = list(dict.fromkeys(u.rstrip(".,;:") for u in _URL.findall(out["upstream"])))
    out["summary"] = summary
    return out


def find(module):
    """``importlib``'s spec of ``module``, found without importing it (its parent packages are imported), or
    None."""
    import importlib.util

    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def record(spec, found=None):
    """The fields of ``spec``'s record, read from its module's source, or None (no record, no source)."""
    found = found or find(spec.module)
    text = source(found) if found is not None else None
    if text is not None:
        return parse(spec.id, docstring(text))
    if found is None:
        return None
    # A sourceless install (bytecode only): the compiled module's own docstring, imported (a patch module imports
    # the standard library only at its top; this runs for list / status / doctor, never at start-up).
    import importlib

    try:
        return parse(spec.id, importlib.import_module(spec.module).__doc__)
    except Exception:
        return None


def of(spec):
    """``spec``'s prose: its module's record, else what its table gives (an overlay's module without a record).
    Always every key of :data:`KEYS` plus ``affected`` and ``how`` ('' / [] where none is given)."""
    rec = record(spec)
    if rec is not None:
        return rec
    given = spec.toml_prose
    return {"summary": given.get("summary", ""), "upstream": list(given.get("upstream", [])),
            "why": given.get("why", ""), "affected": "", "how": "", "remove_when": given.get("remove_when", "")}


def problem(spec, found):
    """``(keys, text)``: why ``spec``'s prose is not in exactly one place, or None. ``found`` is its module's
    spec (:func:`find`); only the first bytes of the source are looked at (see :func:`opens_record`)."""
    text = source(found) if found is not None else None
    if text is None and "summary" not in spec.toml_prose:
        return None  # a sourceless install: nothing to check here, and no reason to run the host unpatched
    has = text is not None and opens_record(spec.id, text)
    given = [k for k in KEYS if k in spec.toml_prose]
    if has and given:
        return (tuple(given), f"key(s) {', '.join(map(repr, given))}: module {spec.module!r} opens with its record, "
                              "the one source of a patch's prose: remove them from the table")
    if not has and "summary" not in spec.toml_prose:
        return (("module",), f"module {spec.module!r} has no record (a docstring opening '{spec.id}: <summary>', "
                             "fields as in omni_patches/patches/__init__.py) and the entry gives no 'summary'")
    return None


def problems(specs):
    """:func:`problem` of every spec in ``specs`` whose module can be found, as the registry words it (``list``
    reports them; ``status``, ``doctor`` and start-up see them through :func:`omni_patches.gates.check_spec`)."""
    out = []
    for spec in specs:
        found = find(spec.module) if spec.error is None else None
        bad = problem(spec, found) if found is not None else None
        if bad:
            out.append(f"{spec.where(*bad[0])}: patch {spec.id!r}: {bad[1]}")
    return out
