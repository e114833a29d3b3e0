"""Every real patch in patches.toml passes the shared contract (:mod:`omni_patches.testing`)."""
from pathlib import Path

import pytest

from omni_patches import registry, testing
from support.contract import case_modules, run_child

SPECS = registry.load([registry.builtin_path()]).specs
CASES = {name: module.CASE for name, module in case_modules().items()}  # tests/patches/<patch module>/case.py


def _lazy(affected):
    """Activation before the target's import is the engine's import hook, the same for every release: it runs on
    the oldest and the newest affected release (indexes into ``affected``); the eager check runs on every one."""
    return sorted({0, len(affected) - 1}) if affected else []


def _params():
    for name, case in CASES.items():
        # A case whose environments preload their deps runs on one worker (one xdist group): each preloading zygote
        # is then started once, not once per worker (3 workers: the preloads cost about what they saved).
        marks = [pytest.mark.xdist_group(f"contract-preload:{name}")] if any(e.preload for e in case.envs()) else []
        for kind, i, label in testing.parts(case, lazy=_lazy(case.affected)):
            yield pytest.param(f"patches.{name}.case", kind, i, id=f"{case.patch_id}-{kind}-{label}", marks=marks)


def test_every_patch_has_a_contract_case():
    covered = {c.patch_id for c in CASES.values()}
    assert set(SPECS) <= covered, f"patches without a tests/patches/<module>/case.py: {sorted(set(SPECS) - covered)}"
    for case in CASES.values():
        assert case.affected and case.skipped and case.drifted, f"{case.patch_id}: every part of the contract"
        # Patches never break the call they wrap: an input the wrapper was not built for runs stock's code.
        assert case.unexpected, f"{case.patch_id}: an `unexpected` input (omni_patches.testing)"
        assert all(isinstance(u, testing.Unexpected) and u.note for u in case.unexpected), case.patch_id
        spec = SPECS.get(case.patch_id)
        if spec is not None and spec.source_builds == "features":  # decided by features: show it does
            assert any(state == "applied" for _, state, _ in case.source_built), \
                f"{case.patch_id}: a 'source build' variant that applies (omni_patches.testing)"


@pytest.mark.parametrize("case_ref,kind,index", list(_params()))
def test_contract(case_ref, kind, index):
    report = run_child(case_ref, kind, index)
    assert report["ok"], report


# -- the public harness, as an operator uses it for an overlay patch ------------------------------------------------
OVERLAY_CASE = """
from omni_patches.testing import Case, Env

SITE = {site!r}
CASE = Case(
    patch_id="fake-double",
    affected=[Env("fake-omni-0.28.0", lambda: [SITE + "/affected"])],
    skipped=[(Env("fake-omni-0.30.0", lambda: [SITE + "/fixed"]), "skipped:version", "fixed upstream")],
    drifted=[(Env.edited("fake-omni-0.28.0-renamed", Env("base", lambda: [SITE + "/affected"]), "fakeomni/loader.py",
                         "def compute(x, scale=1):", "def compute(x, factor=1):"), "no parameter(s) scale")],
)
"""


def test_the_public_harness_runs_an_overlay_patch(tmp_path, monkeypatch):
    """An operator's own patch (``OMNI_PATCHES_CONFIG``) through :mod:`omni_patches.testing` alone: every part
    passes, and a case that expects the wrong thing fails with the child's words."""
    from support.fakes import entry, fake_omni, registry_text

    fake_omni(tmp_path / "affected", "0.28.0")
    fake_omni(tmp_path / "fixed", "0.30.0")
    (tmp_path / "overlay.toml").write_text(registry_text(entry()))
    (tmp_path / "my_case.py").write_text(OVERLAY_CASE.format(site=str(tmp_path)))
    monkeypatch.setenv("OMNI_PATCHES_CONFIG", str(tmp_path / "overlay.toml"))
    monkeypatch.setenv("OMNI_TEST_CACHE", str(tmp_path / "cache"))
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        import my_case
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_case", None)
    tests = Path(__file__).parent  # fakepatches.double, the overlay's patch module
    parts = testing.parts(my_case.CASE)
    assert [k for k, _, _ in parts] == ["affected", "lazy", "skipped", "drifted"]
    reports = {kind: testing.check("my_case", kind, index, pythonpath=[tmp_path, tests]) for kind, index, _ in parts}
    assert all(r["ok"] and r["patch"] == "fake-double" for r in reports.values()), reports
    assert "reverted, then applied again" in reports["affected"]["reload"], reports["affected"]
    (tmp_path / "my_case.py").write_text(OVERLAY_CASE.format(site=str(tmp_path)).replace(
        '"skipped:version", "fixed upstream"', '"skipped:version", "not what it says"'))
    with pytest.raises(AssertionError, match="'not what it says' not in"):
        testing.check("my_case", "skipped", 0, pythonpath=[tmp_path, tests])
    with pytest.raises(ValueError):
        testing.check("my_case", "sideways", 0)


def test_a_patch_is_checked_without_the_siblings_that_wrap_its_targets(tmp_path, monkeypatch):
    """A second overlay patch wraps the same function: the contract of the first needs nothing of its case about
    it (its child switches the sibling off: undo restores the original objects, the skipped parts change
    nothing), and a case that switches the sibling on keeps it on (then the sibling's wrapper, installed after
    the patch's, stands in the way of its undo)."""
    from omni_patches.testing.child import siblings
    from support.fakes import entry, fake_omni, registry_text

    fake_omni(tmp_path / "affected", "0.28.0")
    fake_omni(tmp_path / "fixed", "0.30.0")
    (tmp_path / "overlay.toml").write_text(registry_text(entry(), entry("fake-double-too")))
    (tmp_path / "sib_case.py").write_text(OVERLAY_CASE.format(site=str(tmp_path)))
    monkeypatch.setenv("OMNI_PATCHES_CONFIG", str(tmp_path / "overlay.toml"))
    monkeypatch.setenv("OMNI_TEST_CACHE", str(tmp_path / "cache"))
    specs = registry.load([registry.builtin_path(), tmp_path / "overlay.toml"]).specs
    assert siblings(specs, specs["fake-double"]) == ["fake-double-too"]
    assert "fake-double-too" not in siblings(specs, specs["omni-sleep-validate-first"])
    tests = Path(__file__).parent
    for kind in ("affected", "skipped"):
        assert testing.check("sib_case", kind, 0, pythonpath=[tmp_path, tests])["ok"]
    (tmp_path / "sib_case.py").write_text(OVERLAY_CASE.format(site=str(tmp_path)).replace(
        'Env("fake-omni-0.28.0", lambda: [SITE + "/affected"])',
        'Env("fake-omni-0.28.0", lambda: [SITE + "/affected"], env={"OMNI_PATCHES_FAKE_DOUBLE_TOO": "1"})'))
    with pytest.raises(AssertionError, match="replaced by something else after fake-double patched it"):
        testing.check("sib_case", "affected", 0, pythonpath=[tmp_path, tests])


def test_an_edited_copy_leaves_its_source_as_it_was(tmp_path, monkeypatch):
    """``Env.edited`` hard-links the source tree: the edited file and the copy's ``.complete`` marker are files of
    the copy's own, so the source (a finished cache entry, with its own marker) reads as before and stays
    finished."""
    from omni_patches.tools import atomic

    monkeypatch.setenv("OMNI_TEST_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "release"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("def run_loop():\n    pass\n")
    (src / "pkg" / "other.py").write_text("X = 1\n")
    (src / atomic.COMPLETE).write_text("")
    env = testing.Env.edited("renamed", testing.Env("base", lambda: [str(src), "/elsewhere"]), "pkg/mod.py",
                             "def run_loop(", "def serve(")
    first = env.paths()
    dst = Path(first[0])
    assert first[1:] == ["/elsewhere"] and env.paths() == first  # built once
    assert (dst / "pkg" / "mod.py").read_text().startswith("def serve(")
    assert (src / "pkg" / "mod.py").read_text().startswith("def run_loop(")
    assert atomic.is_complete(src) and atomic.is_complete(dst, testing.contract.EDITED_LAYOUT)
    assert not (dst / atomic.COMPLETE).samefile(src / atomic.COMPLETE)
    assert (dst / "pkg" / "other.py").samefile(src / "pkg" / "other.py")  # the rest: links, not copies


# -- the call-time rule's mechanism (PatchRun.fallback, reached as ctx.run), without a target ----------------------
def _run(patch_id="p"):
    from omni_patches.runs import PatchRun

    return PatchRun.standalone(patch_id)


def test_fallback_is_noted_and_logged_once_per_reason(mocker):
    from omni_patches import log

    p, q = _run("p"), _run("q")
    once = mocker.spy(log, "once")
    assert p.fallback("a weight it was not built for") is True
    assert p.fallback("a weight it was not built for") is False  # the second time: nothing at all
    assert q.fallback("a weight it was not built for") is True  # per patch
    key = ("fallback", "a weight it was not built for")
    assert p.notes == q.notes == {key: "ran the original code: a weight it was not built for"}
    assert "ran the original code: a weight it was not built for" in p.full_reason()
    assert once.call_count == 2
    assert _run("p").fallback("a weight it was not built for") is True  # a new activation's run starts over


def test_fallback_lists_a_bounded_number_of_reasons():
    from omni_patches import runs

    p = _run()
    for i in range(runs.MAX_FALLBACK_NOTES + 3):
        p.fallback(f"reason {i}")
    assert len(p.notes) == runs.MAX_FALLBACK_NOTES + 1 and ("fallback", "more") in p.notes
    assert p.notes[("fallback", "more")] == "ran the original code for 3 more kind(s) of input (see the log)"


def test_ctx_stock_notes_then_runs_the_original_with_its_outcome():
    from omni_patches.context import PatchContext

    run = _run()
    ctx = PatchContext(type("Spec", (), {"id": "p"})(), "t", None, {}, run)
    assert ctx.stock("why", lambda a, b=0: a + b, (1,), {"b": 2}) == 3
    with pytest.raises(ZeroDivisionError):  # stock's exception, unchanged
        ctx.stock("why", lambda: 1 / 0, (), {})
    assert list(run.notes.values()) == ["ran the original code: why"] and run.fallback("why") is False


def test_a_note_failure_never_reaches_the_wrapper(mocker):
    from omni_patches.runs import PatchRun

    # on_note: what the engine hands in (the process record's refresh), broken here
    run = PatchRun.standalone("p", on_note=mocker.Mock(side_effect=RuntimeError("broken")))
    assert run.fallback("x") is True  # no exception
    assert run.note("y") is False


def test_counters_count_per_run():
    p = _run()
    assert [p.count("sent"), p.count("sent"), p.count("other")] == [1, 2, 1]
    assert _run().count("sent") == 1


def test_tally_counts_notes_and_logs_the_first_time_only(mocker):
    from omni_patches import log

    p = _run("p")
    once = mocker.spy(log, "once")
    assert p.tally("sent", "{n} call(s) raised instead of hanging", log="the first one") == 1
    assert p.tally("sent", "{n} call(s) raised instead of hanging", by=3, log="the first one") == 4
    assert p.notes == {"sent": "4 call(s) raised instead of hanging"} and p.counts == {"sent": 4}
    assert once.call_count == 1 and once.call_args.args[1:] == (("tally", "p", "sent"), "%s: %s", "p", "the first one")
    assert p.tally("quiet", "{n} quiet") == 1 and once.call_count == 1  # no log= : a note only
    assert p.tally("bad", "{missing} key") == 0  # a text that cannot be formatted: nothing raised into the wrapper


def test_own_function_is_the_plain_method_the_class_defines_itself():
    import types

    from omni_patches.context import Drift, PatchContext

    class Base:
        def inherited(self):
            pass

    class Target(Base):
        def own(self):
            pass

        prop = property(lambda self: 1)

    module = types.SimpleNamespace(Target=Target, value=3)
    ctx = PatchContext(type("Spec", (), {"id": "p"})(), "t", module, {}, _run())
    assert ctx.own_function("Target", "own") is vars(Target)["own"]
    for cls_path, name, why in [("Target", "inherited", "defines no plain method inherited"),
                                ("Target", "prop", "defines no plain method prop"),
                                ("value", "own", "value is not a class"),
                                ("Missing", "own", "no attribute 'Missing'")]:
        with pytest.raises(Drift, match=why):
            ctx.own_function(cls_path, name)
