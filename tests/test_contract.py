"""Every real patch in patches.toml passes the shared contract (see tests/support/contract.py)."""
import importlib
import pkgutil

import pytest

import patches
from omni_patches import registry
from support.contract import Unexpected, run_child

SPECS = registry.load([registry.builtin_path()]).specs
CASES = {}
for info in pkgutil.iter_modules(patches.__path__):  # tests/patches/<patch module>/case.py
    if info.ispkg:
        CASES[info.name] = importlib.import_module(f"patches.{info.name}.case").CASE


def _lazy(affected):
    """Activation before the target's import is the engine's import hook, the same for every release: it runs on
    the oldest and the newest affected release (indexes into ``affected``); the eager check runs on every one."""
    return sorted({0, len(affected) - 1}) if affected else []


def _params():
    for name, case in CASES.items():
        for kind, items in (("affected", case.affected), ("lazy", case.affected), ("skipped", case.skipped),
                            ("drifted", case.drifted), ("source", case.source_built),
                            ("unexpected", case.unexpected)):
            for i, item in enumerate(items):
                if kind == "lazy" and i not in _lazy(items):
                    continue
                label = (item if kind in ("affected", "lazy", "unexpected") else item[0]).label
                yield pytest.param(name, kind, i, id=f"{case.patch_id}-{kind}-{label}")


def test_every_patch_has_a_contract_case():
    covered = {c.patch_id for c in CASES.values()}
    assert set(SPECS) <= covered, f"patches without a tests/patches/<module>/case.py: {sorted(set(SPECS) - covered)}"
    for case in CASES.values():
        assert case.affected and case.skipped and case.drifted, f"{case.patch_id}: every part of the contract"
        # Patches never break the call they wrap: an input the wrapper was not built for runs stock's code.
        assert case.unexpected, f"{case.patch_id}: an `unexpected` input (tests/support/contract.py)"
        assert all(isinstance(u, Unexpected) and u.note for u in case.unexpected), case.patch_id
        spec = SPECS.get(case.patch_id)
        if spec is not None and spec.source_builds == "features":  # decided by features: show it does
            assert any(state == "applied" for _, state, _ in case.source_built), \
                f"{case.patch_id}: a 'source build' variant that applies (tests/support/contract.py)"


@pytest.mark.parametrize("case_module,kind,index", list(_params()))
def test_contract(case_module, kind, index):
    report = run_child(case_module, kind, index)
    assert report["ok"], report


# -- the call-time rule's mechanism (omni_patches.context.fallback), without a target ------------------------------
def test_fallback_is_noted_and_logged_once_per_reason(mocker):
    from omni_patches import context, engine, log

    mocker.patch.object(engine, "_state", object())  # one activation
    note = mocker.patch.object(engine, "note", return_value=True)
    once = mocker.spy(log, "once")
    assert context.fallback("p", "a weight it was not built for") is True
    assert context.fallback("p", "a weight it was not built for") is False  # the second time: nothing at all
    assert context.fallback("q", "a weight it was not built for") is True  # per patch
    assert note.call_args_list == [
        mocker.call("p", "ran the original code: a weight it was not built for",
                    key=("fallback", "a weight it was not built for")),
        mocker.call("q", "ran the original code: a weight it was not built for",
                    key=("fallback", "a weight it was not built for"))]
    assert once.call_count == 2
    mocker.patch.object(engine, "_state", object())  # a new activation starts over
    assert context.fallback("p", "a weight it was not built for") is True


def test_fallback_lists_a_bounded_number_of_reasons(mocker):
    from omni_patches import context, engine

    mocker.patch.object(engine, "_state", object())
    note = mocker.patch.object(engine, "note", return_value=True)
    for i in range(context.MAX_FALLBACK_NOTES + 3):
        context.fallback("p", f"reason {i}")
    keys = {c.kwargs["key"] for c in note.call_args_list}
    assert len(keys) == context.MAX_FALLBACK_NOTES + 1 and ("fallback", "more") in keys
    assert note.call_args_list[-1].args[1] == "ran the original code for 3 more kind(s) of input (see the log)"


def test_ctx_stock_notes_then_runs_the_original_with_its_outcome(mocker):
    from omni_patches import context, engine
    from omni_patches.context import PatchContext

    mocker.patch.object(engine, "_state", object())
    note = mocker.patch.object(engine, "note", return_value=True)
    ctx = PatchContext(type("Spec", (), {"id": "p"})(), "t", None, {})
    assert ctx.stock("why", lambda a, b=0: a + b, (1,), {"b": 2}) == 3
    with pytest.raises(ZeroDivisionError):  # stock's exception, unchanged
        ctx.stock("why", lambda: 1 / 0, (), {})
    assert note.call_count == 1 and context.fallback("p", "why") is False


def test_a_note_failure_never_reaches_the_wrapper(mocker):
    from omni_patches import context, engine

    mocker.patch.object(engine, "_state", object())
    mocker.patch.object(engine, "note", side_effect=RuntimeError("broken"))
    context.fallback("p", "x")  # no exception
