"""Skeleton stubs have the shape of the real functions: the same file imported for real and as a skeleton agree
on every attribute a patch's check may read (signature, names, code names, line, file, kind)."""
import asyncio
import importlib
import inspect
import sys
import textwrap

import pytest

from omni_patches.tools import skeleton

SOURCE = textwrap.dedent('''
    import os

    LIMIT = 3


    def plain(a, b=2, *args, c, d=None, **kw):
        return os.path.join(a, b)


    def positional_only(x, /, y=(1, 2), *, z="s"):
        return x


    async def coroutine(self, timeout=1.5):
        await other()


    def same_parameters_as_plain(a, b=2, *args, c, d=None, **kw):
        return LIMIT


    class Runner:
        def forward(self, hidden_states, router_logits, return_with_event=False):
            return self._forward_impl(hidden_states)

        @classmethod
        def build(cls, config):
            return cls()

        @staticmethod
        def helper(value, scale=len("abc")):
            return value

        @property
        def size(self):
            return self.limit

        class Inner:
            def step(self, n):
                return n + 1
''')

FUNCTIONS = ["plain", "positional_only", "coroutine", "same_parameters_as_plain", "Runner.forward",
             "Runner.build", "Runner.helper", "Runner.Inner.step"]


def _get(module, dotted):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture
def both(tmp_path):
    pkg = tmp_path / "skelpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(SOURCE)
    sys.path.insert(0, str(tmp_path))
    try:
        real = importlib.import_module("skelpkg.mod")
        with skeleton.Imports([(str(tmp_path), {"skelpkg"})]):
            yield real, importlib.import_module("skelpkg.mod")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.partition(".")[0] == "skelpkg"]:
            del sys.modules[name]


@pytest.mark.parametrize("dotted", FUNCTIONS)
def test_stub_has_the_shape_of_the_real_function(both, dotted):
    real, skel = both
    r, s = _get(real, dotted), _get(skel, dotted)
    assert s is not r
    assert len(inspect.signature(s).parameters) == len(inspect.signature(r).parameters)
    for (rn, rp), (sn, sp) in zip(inspect.signature(r).parameters.items(), inspect.signature(s).parameters.items()):
        assert (sn, sp.kind, sp.default is inspect.Parameter.empty) == (rn, rp.kind, rp.default is inspect.Parameter.empty)
        if sp.default is not inspect.Parameter.empty and not isinstance(sp.default, skeleton.Default):
            assert sp.default == rp.default, (dotted, rn)  # a literal: the value itself
    rf, sf = inspect.unwrap(getattr(r, "__func__", r)), inspect.unwrap(getattr(s, "__func__", s))
    assert (sf.__name__, sf.__qualname__, sf.__module__) == (rf.__name__, rf.__qualname__, rf.__module__)
    assert (sf.__code__.co_name, sf.__code__.co_qualname) == (rf.__code__.co_name, rf.__code__.co_qualname)
    assert (sf.__code__.co_filename, sf.__code__.co_firstlineno) == (rf.__code__.co_filename, rf.__code__.co_firstlineno)
    assert set(rf.__code__.co_names) <= set(sf.__code__.co_names)
    assert inspect.iscoroutinefunction(sf) == inspect.iscoroutinefunction(rf)
    assert inspect.getsource(sf) == inspect.getsource(rf)


def test_stubs_sharing_a_parameter_list_stay_distinct_and_never_run_upstream_code(both):
    _, skel = both
    a, b = skel.plain, skel.same_parameters_as_plain
    assert a.__code__ is not b.__code__ and (a.__name__, b.__name__) == ("plain", "same_parameters_as_plain")
    assert "join" in a.__code__.co_names and "LIMIT" in b.__code__.co_names and "LIMIT" not in a.__code__.co_names
    for call in (lambda: a("x", c=1), lambda: b("x", c=1), lambda: skel.Runner.build(None),
                 lambda: skel.Runner.helper(1), lambda: asyncio.run(skel.coroutine(None))):
        with pytest.raises(NotImplementedError, match="skeleton stub"):
            call()
    assert isinstance(skel.Runner.__dict__["size"], property)
    assert isinstance(skel.Runner.__dict__["build"], classmethod)
    assert isinstance(skel.Runner.__dict__["helper"], staticmethod)


# Non-literal defaults keep their source text: after a form feed (the parser does not split lines there,
# str.splitlines does), after non-ASCII text (offsets are UTF-8 bytes), over several lines, with \r\n endings.
DEFAULTS = (
    '"""Modul für Tests: ünïcödé before the defaults."""\r\n'
    "import os\r\n"
    "\x0c\r\n"
    "def spans(a=os.sep, b=dict(x=1,\r\n"
    "                          y=[2, 3]), *, c=len('ä') + 1):\r\n"
    "    return a\r\n"
    "\r\n"
    "\x0cclass K:\r\n"
    "    def m(self, d=os.path.join('é', 'f')): return d"
)


def test_non_literal_defaults_keep_their_source_text(tmp_path):
    import ast

    pkg = tmp_path / "skeldefaults"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_bytes(DEFAULTS.encode())
    tree = ast.parse(DEFAULTS.encode())
    want = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            args = [*fn.args.posonlyargs, *fn.args.args]
            for arg, node in zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults):
                want[(fn.name, arg.arg)] = ast.get_source_segment(DEFAULTS, node)
            for arg, node in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
                want[(fn.name, arg.arg)] = ast.get_source_segment(DEFAULTS, node)
    with skeleton.Imports([(str(tmp_path), {"skeldefaults"})]):
        mod = importlib.import_module("skeldefaults.mod")
        got = {(f.__name__, name): repr(p.default) for f in (mod.spans, mod.K.m)
               for name, p in inspect.signature(f).parameters.items() if p.default is not inspect.Parameter.empty}
    assert got == want and len(want) == 4, (got, want)
    assert want[("spans", "b")] == "dict(x=1,\r\n                          y=[2, 3])"


LAZY = {
    "__init__.py": "",
    "target.py": "import skellazy.other\nfrom skellazy import helper\nfrom skellazy.dep import thing\n\n\n"
                 "def f():\n    return thing()\n",
    "other.py": "def o():\n    pass\n",
    "helper.py": "def h():\n    pass\n",
    "dep.py": "def thing():\n    pass\n",
    "unused.py": "X = 1\n",
    "broken.py": "def (:\n",
}


def test_imports_are_built_on_first_access_only(tmp_path, mocker):
    """An audit parses only the files its patches reach: importing a skeleton builds that file (and its packages),
    nothing it imports; each import binding, and any submodule of a skeleton package, is built when first used --
    and a file that does not parse is an absent attribute there, not an error."""
    pkg = tmp_path / "skellazy"
    pkg.mkdir()
    for name, text in LAZY.items():
        (pkg / name).write_text(text)
    builds = mocker.spy(skeleton.Loader, "exec_module")
    with skeleton.Imports([(str(tmp_path), {"skellazy"})]):
        target = importlib.import_module("skellazy.target")
        assert sorted(m for m in sys.modules if m.startswith("skellazy")) == ["skellazy", "skellazy.target"]
        assert builds.call_count == 2
        assert target.skellazy.other.o.__qualname__ == "o"  # `import skellazy.other`: the package's submodule
        assert target.helper.h.__module__ == "skellazy.helper"
        assert target.thing.__module__ == "skellazy.dep"
        package = sys.modules["skellazy"]
        assert isinstance(package.unused.X, skeleton.Placeholder)  # a submodule no file imports
        assert not hasattr(package, "broken") and not hasattr(package, "missing")
        assert sorted(m for m in sys.modules if m.startswith("skellazy.")) == [
            "skellazy.dep", "skellazy.helper", "skellazy.other", "skellazy.target", "skellazy.unused"]


def test_what_a_build_looks_up_is_not_counted_as_consulted(tmp_path):
    """A class whose base another skeleton imports from outside the audited files: building it (which now happens
    when a patch first reaches it, after the audit cleared ``consulted``) records nothing; the patch's own look-up
    of the outside name is recorded."""
    pkg = tmp_path / "skelbuild"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "t.py").write_text("from skelbuild import a\n")
    (pkg / "a.py").write_text("from skelbuild.b import Base\n\n\nclass K(Base):\n    pass\n")
    (pkg / "b.py").write_text("from outside_the_audit import Base\n")
    with skeleton.Imports([(str(tmp_path), {"skelbuild"})]):
        t = importlib.import_module("skelbuild.t")
        skeleton.consulted.clear()
        assert t.a.K.__name__ == "K"
        assert skeleton.consulted == set()
        assert isinstance(sys.modules["skelbuild.b"].Base, skeleton.External)
        assert skeleton.consulted == {"outside_the_audit.Base"}
    skeleton.consulted.clear()
