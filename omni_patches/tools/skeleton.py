"""Skeleton modules: the *shape* of upstream source files, built from their AST, never from running them.

``omni-patches audit`` runs each patch's real ``check(ctx)`` / ``apply(ctx)`` (dry run) against skeletons of
the target modules of a downloaded wheel, so a patch's drift logic is written once. A skeleton holds, for
every top-level function, class and method of the file, a stub generated here with

* the same name, qualified name, parameter names, kinds and order (defaults: literals, else a placeholder),
  and the same ``classmethod`` / ``staticmethod`` / ``property`` / ``async`` kind;
* ``__code__.co_names``, ``co_firstlineno`` and ``co_filename`` of the upstream function (taken from
  ``compile()`` of the file, which parses but runs nothing), so checks reading ``co_names`` or
  ``inspect.getsource`` see upstream's own text;
* classes with their in-source bases (so ``__mro__``/inheritance hold) and ``__module__``/``__qualname__``;
* a :class:`Placeholder` for every name assigned at module or class level;
* the names the file imports, resolved on first access: another file of the audited distributions gives
  its skeleton (imported through :class:`Finder`); anything else an :class:`External` that accepts every
  attribute and parameter and records that it was consulted (reported as "not checked").

Stubs raise ``NotImplementedError`` when called. Upstream code is never executed: only our generated
``def`` lines are.
"""
import ast
import builtins
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import types

_MISSING = object()
consulted = set()  # dotted names of External objects the patches looked at (reset by the caller)
_building = 0  # skeleton builds under way in this process: what a build looks up is not a patch's consultation


def _consult(name):
    if not _building:
        consulted.add(name)


class Placeholder:
    """A name upstream assigns (a constant, a group, a lock): exists, value unknown."""

    __slots__ = ("_name",)

    def __init__(self, name):
        self._name = name

    def __repr__(self):
        return f"<skeleton value {self._name}>"


class Default:
    """A parameter default that is not a literal: keeps its source text for signatures."""

    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


class _AnyParams(dict):
    """Parameters of an External: every name is accepted."""

    def __contains__(self, key):
        return True


class _AnySignature(inspect.Signature):
    __slots__ = ()

    @property
    def parameters(self):
        return _AnyParams(super().parameters)


class External:
    """Something from outside the audited distributions (vllm when only vllm-omni is given, torch...).

    Every attribute exists and every parameter is accepted; each one a patch consults is recorded so the
    audit can say which facts it could not check.
    """

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        name = f"{self._name}.{attr}"
        _consult(name)
        return External(name)

    @property
    def __signature__(self):
        _consult(self._name)
        return _AnySignature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                              inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is not part of the audited distributions")

    def __repr__(self):
        return f"<external {self._name}>"


class Sources:
    """Import roots of the audited distributions: ``[(directory, {top-level package names})]``."""

    def __init__(self, roots):
        self.roots = [(os.path.abspath(r), frozenset(t)) for r, t in roots]
        self.tops = set().union(*(t for _, t in self.roots)) if self.roots else set()

    def covers(self, fullname):
        return fullname.partition(".")[0] in self.tops

    def locate(self, fullname):
        """``(path, is_package)`` of the file that defines ``fullname``, or None."""
        parts = fullname.split(".")
        for root, tops in self.roots:
            if parts[0] not in tops:
                continue
            base = os.path.join(root, *parts)
            init = os.path.join(base, "__init__.py")
            if os.path.isfile(init):
                return init, True
            if os.path.isfile(base + ".py"):
                return base + ".py", False
            if len(parts) > 1 and os.path.isdir(base):  # namespace package inside a distribution
                return base, True
        return None


class Finder(importlib.abc.MetaPathFinder):
    """Serves skeletons for the audited distributions' modules and blocks everything else under their
    top-level packages, so an installed copy is never imported by mistake."""

    def __init__(self, sources):
        self.sources = sources

    def find_spec(self, fullname, path=None, target=None):
        if not self.sources.covers(fullname):
            return None
        found = self.sources.locate(fullname)
        if found is None:
            raise ModuleNotFoundError(f"{fullname} is not in the audited distributions", name=fullname)
        file, is_pkg = found
        loader = Loader(self.sources, file)
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=file, is_package=is_pkg)
        if is_pkg:
            spec.submodule_search_locations = [file if os.path.isdir(file) else os.path.dirname(file)]
        spec.has_location = not os.path.isdir(file)
        return spec

    def invalidate_caches(self):
        pass


class Loader(importlib.abc.Loader):
    def __init__(self, sources, file):
        self.sources, self.file = sources, file

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if os.path.isdir(self.file):
            return  # namespace package: nothing to build
        _Builder(self.sources, module, self.file).build()

    def get_source(self, fullname):  # linecache / inspect
        with open(self.file, encoding="utf-8", errors="replace") as fh:
            return fh.read()


class Imported:
    """A lazy import binding: resolved at first attribute access on the skeleton module."""

    __slots__ = ("module", "attr")

    def __init__(self, module, attr=None):
        self.module, self.attr = module, attr


_STUB_GLOBALS = {"__builtins__": builtins}
# A source line with its end, split where the parser splits (\r\n, \r, \n; not at a form feed as str.splitlines).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def _segment(lines, node):
    """``ast.get_source_segment`` on lines split once per file (it splits the whole source at every call; a
    module's defaults made that most of an audit's time). Offsets are in UTF-8 bytes, as the parser gives them."""
    end_lineno, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if end_lineno is None or end_col is None or end_lineno > len(lines):
        return None
    first, last = node.lineno - 1, end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:end_col].decode()
    return "".join([lines[first].encode()[node.col_offset:].decode(), *lines[first + 1:last],
                    lines[last].encode()[:end_col].decode()])


@functools.lru_cache(maxsize=None)
def _stub_code(params, is_async):
    """The code of ``def _(<params>): raise NotImplementedError``, compiled once per parameter list (an audit
    builds thousands of stubs from a few hundred distinct lists); each stub renames a copy of it."""
    text = f"{'async def' if is_async else 'def'} _stub({params}):\n    raise NotImplementedError('skeleton stub')\n"
    scope = {}
    exec(compile(text, "<omni-patches skeleton>", "exec", dont_inherit=True), scope)
    return scope["_stub"].__code__


def _codes(code, out):
    for const in code.co_consts:
        if isinstance(const, type(code)):
            out.setdefault(const.co_qualname, const)
            _codes(const, out)
    return out


class _Builder:
    def __init__(self, sources, module, file):
        self.sources, self.module, self.file = sources, module, file
        self.name = module.__name__
        self.package = self.name if hasattr(module, "__path__") else self.name.rpartition(".")[0]
        self.imports = {}  # bound name -> Imported
        self.star = []  # modules star-imported from the audited sources

    def build(self):
        """Fill the module from its file. Nothing it imports is built here: every import binding (and every
        submodule, through the module's ``__getattr__``) is resolved on first access, so an audit parses only the
        files its patches reach -- parsing is most of its time (the files Python would import along, vllm-omni's
        whole tree for one target, made an audit 5-20x slower: docs/audit.md)."""
        with open(self.file, "rb") as fh:
            source = fh.read()
        tree = ast.parse(source, self.file)
        self.codes = _codes(compile(tree, self.file, "exec", dont_inherit=True), {})
        self.lines = _LINE.findall(source.decode("utf-8", "replace"))
        ns = vars(self.module)
        global _building
        _building += 1  # a base class resolved here may pass through another skeleton's __getattr__
        try:
            self._body(tree.body, ns, "", top=True)
        finally:
            _building -= 1
        imports, star, sources, name = self.imports, self.star, self.sources, self.name

        def __getattr__(attr):
            binding = imports.get(attr)
            if binding is not None:
                value = _resolve(sources, binding, record=True)
                if not _building:  # kept once a patch looked it up (a look-up left to a build is not recorded)
                    ns[attr] = value
                return value
            for mod in star:
                try:
                    return getattr(importlib.import_module(mod), attr)
                except (ImportError, AttributeError):
                    continue
            if sources.locate(f"{name}.{attr}") is not None:
                # A submodule nobody imported yet: Python would have it here once any file imported it (every
                # in-source import is resolved on first access, not at build time: see build()).
                try:
                    return importlib.import_module(f"{name}.{attr}")
                except Exception:  # a file that does not parse: that file's problem, the attribute is absent
                    pass
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")

        ns["__getattr__"] = __getattr__

    # -- statements ---------------------------------------------------------------------------------
    def _body(self, stmts, ns, prefix, top=False, conditional=False):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._set(ns, node.name, lambda n=node: self._function(n, prefix), conditional)
            elif isinstance(node, ast.ClassDef):
                self._set(ns, node.name, lambda n=node: self._class(n, prefix, ns), conditional)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                if isinstance(node, ast.AnnAssign) and node.value is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in _names(t):
                        self._set(ns, n, lambda n=n: Placeholder(prefix + n), conditional)
            elif top and isinstance(node, (ast.Import, ast.ImportFrom)):
                self._import(node, conditional)
            elif isinstance(node, ast.If):
                if top and _is_type_checking(node.test):
                    continue
                self._body(node.body, ns, prefix, top, True)
                self._body(node.orelse, ns, prefix, top, True)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                self._body(node.body, ns, prefix, top, conditional)
                for handler in node.handlers:
                    self._body(handler.body, ns, prefix, top, True)
                self._body(node.orelse, ns, prefix, top, conditional)
                self._body(node.finalbody, ns, prefix, top, conditional)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                self._body(node.body, ns, prefix, top, True)

    def _set(self, ns, name, make, conditional):
        # In a conditional branch (if/else, except) the first definition wins; plain statements override.
        if conditional and (name in ns or name in self.imports):
            return
        self.imports.pop(name, None)
        ns[name] = make()

    def _import(self, node, conditional):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound, binding = alias.asname, Imported(alias.name)
                else:
                    bound = alias.name.partition(".")[0]
                    binding = Imported(bound)
                self._bind(bound, binding, conditional)
            return
        base = self._absolute(node.module, node.level)
        if base is None:
            return
        for alias in node.names:
            if alias.name == "*":
                if self.sources.covers(base):
                    self.star.append(base)
                continue
            sub = f"{base}.{alias.name}"
            if self.sources.covers(sub) and self.sources.locate(sub) is not None:
                binding = Imported(sub)  # a submodule
            else:
                binding = Imported(base, alias.name)
            self._bind(alias.asname or alias.name, binding, conditional)

    def _bind(self, name, binding, conditional):
        ns = vars(self.module)
        if conditional and (name in ns or name in self.imports):
            return
        ns.pop(name, None)
        self.imports[name] = binding

    def _absolute(self, module, level):
        if not level:
            return module
        parts = self.package.split(".") if self.package else []
        if level - 1 > len(parts):
            return None
        base = ".".join(parts[:len(parts) - (level - 1)])
        return f"{base}.{module}" if module else base

    # -- definitions --------------------------------------------------------------------------------
    def _function(self, node, prefix):
        kind, deco_names = None, [_deco_name(d) for d in node.decorator_list]
        for d in deco_names:
            if d in ("classmethod", "staticmethod", "property", "cached_property", "functools.cached_property"):
                kind = d.rpartition(".")[2]
            elif d.endswith((".setter", ".getter", ".deleter")):
                kind = "accessor"
        func = self._stub(node, prefix)
        if kind == "classmethod":
            return classmethod(func)
        if kind == "staticmethod":
            return staticmethod(func)
        if kind in ("property", "cached_property"):
            return property(func)
        return func

    def _stub(self, node, prefix):
        a = node.args
        params, defaults, kwdefaults = [], [], {}
        positional = [*a.posonlyargs, *a.args]
        first_default = len(positional) - len(a.defaults)
        for i, arg in enumerate(positional):
            params.append(arg.arg + ("=None" if i >= first_default else ""))
            if i >= first_default:
                defaults.append(self._default(a.defaults[i - first_default]))
            if a.posonlyargs and i == len(a.posonlyargs) - 1:
                params.append("/")
        if a.vararg:
            params.append("*" + a.vararg.arg)
        elif a.kwonlyargs:
            params.append("*")
        for arg, default in zip(a.kwonlyargs, a.kw_defaults):
            if default is None:
                params.append(arg.arg)
            else:
                params.append(arg.arg + "=None")
                kwdefaults[arg.arg] = self._default(default)
        if a.kwarg:
            params.append("**" + a.kwarg.arg)
        qualname = prefix + node.name
        code = _stub_code(", ".join(params), isinstance(node, ast.AsyncFunctionDef))
        orig = self.codes.get(qualname)
        extra = tuple(n for n in (orig.co_names if orig is not None else ()) if n not in code.co_names)
        func = types.FunctionType(code.replace(
            co_name=node.name, co_names=code.co_names + extra, co_filename=self.file, co_qualname=qualname,
            co_firstlineno=orig.co_firstlineno if orig is not None else node.lineno), _STUB_GLOBALS, node.name)
        func.__defaults__ = tuple(defaults) or None
        func.__kwdefaults__ = kwdefaults or None
        func.__qualname__ = qualname
        func.__module__ = self.name
        func.__doc__ = ast.get_docstring(node)
        return func

    def _default(self, node):
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return Default(_segment(self.lines, node) or "...")

    def _class(self, node, prefix, outer_ns):
        qualname = prefix + node.name
        bases = []
        for b in node.bases:
            base = self._base(b, outer_ns)
            if isinstance(base, type) and base not in bases:
                bases.append(base)
        ns = {"__module__": self.name, "__qualname__": qualname, "__doc__": ast.get_docstring(node)}
        self._body(node.body, ns, qualname + ".")
        for attempt in (tuple(bases), ()):
            try:
                return type(node.name, attempt, ns)
            except TypeError:  # metaclass or MRO conflict among the resolved bases
                continue
        return type(node.name, (), ns)

    def _base(self, expr, ns):
        """A base class defined in the audited sources, or None (external bases are dropped)."""
        if isinstance(expr, ast.Name):
            if expr.id in ns:
                return ns[expr.id]
            binding = self.imports.get(expr.id)
            if binding is not None:
                try:
                    return _resolve(self.sources, binding)
                except Exception:
                    return None
        if isinstance(expr, ast.Attribute):
            dotted = _dotted(expr)
            if dotted:
                head, _, rest = dotted.partition(".")
                binding = self.imports.get(head)
                if binding is not None and binding.attr is None and self.sources.covers(binding.module):
                    try:
                        obj = importlib.import_module(binding.module)
                        for part in rest.split("."):
                            obj = getattr(obj, part)
                        return obj
                    except Exception:
                        return None
        return None


def _resolve(sources, binding, record=False):
    """The object an import binding names; ``record``: the access comes from a patch (not from a build)."""
    mod = binding.module
    dotted = mod if binding.attr is None else f"{mod}.{binding.attr}"
    if sources.covers(mod):
        try:
            module = importlib.import_module(mod)
            return module if binding.attr is None else getattr(module, binding.attr)
        except (ImportError, AttributeError):
            pass
    if record:
        _consult(dotted)
    return External(dotted)


def _names(target):
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _names(t)]
    if isinstance(target, ast.Starred):
        return _names(target.value)
    return []  # attribute / subscript assignments bind no new name


def _dotted(expr):
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def _deco_name(expr):
    if isinstance(expr, ast.Call):
        expr = expr.func
    return _dotted(expr) or ""


def _is_type_checking(test):
    return _dotted(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


class Imports:
    """Context manager: while inside, importing a module of ``roots`` gives its skeleton.

    Whatever ``sys.modules`` held under the audited top-level packages is set aside and restored on exit,
    together with ``sys.meta_path``.
    """

    def __init__(self, roots):
        """``roots``: ``[(directory, {top-level package names})]``."""
        self.sources = Sources(roots)
        self.finder = Finder(self.sources)

    def __enter__(self):
        self.saved = {k: v for k, v in sys.modules.items() if self.sources.covers(k)}
        for k in self.saved:
            del sys.modules[k]
        sys.meta_path.insert(0, self.finder)
        importlib.invalidate_caches()
        return self

    def exists(self, fullname):
        return self.sources.covers(fullname) and self.sources.locate(fullname) is not None

    def __exit__(self, *exc):
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        for k in [k for k in sys.modules if self.sources.covers(k)]:
            del sys.modules[k]
        sys.modules.update(self.saved)
        return False
