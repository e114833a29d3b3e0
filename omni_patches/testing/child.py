"""One contract check in a fresh interpreter: ``python -m omni_patches.testing.child <case module> <kind> <index>``
(see :mod:`omni_patches.testing.contract`)."""
import hashlib
import importlib
import json
import os
import sys

import omni_patches
from omni_patches import engine, flags, registry, wrapping
from omni_patches.states import State
from omni_patches.testing import zygote

DRIFTED_KIND = "drifted"


def _import_targets(spec, env):
    names = env.imports if env.imports is not None else spec.targets
    mods, missing = {}, {}
    for name in names:
        try:
            mods[name] = importlib.import_module(name)
        except ImportError as exc:
            if env.imports is not None:
                raise
            missing[name] = f"{type(exc).__name__}: {exc}"
    return mods, missing


def siblings(specs, spec):
    """The other patches that wrap one of ``spec``'s targets (those it ``needs`` aside): the contract checks a patch
    alone, so they are switched off in its child unless the case's environment says otherwise. What a patch does
    beside its siblings is its own test's to show."""
    targets = set(spec.targets)
    return sorted(other.id for other in specs.values() if other.id != spec.id and other.id not in spec.needs
                  and targets & set(other.targets))


def _snapshot(mods):
    """Identity snapshot of every attribute of the target modules and of the classes defined there."""
    snap = {}
    for mname, mod in mods.items():
        for key, value in list(vars(mod).items()):
            snap[(mname, key)] = value
            if isinstance(value, type) and value.__module__ == mname:
                for ckey, cval in list(vars(value).items()):
                    snap[(mname, f"{key}.{ckey}")] = cval
    return snap


def _changed(before, after):
    keys = set(before) | set(after)
    return sorted(f"{m}:{k}" for m, k in keys if before.get((m, k), KeyError) is not after.get((m, k), KeyError))


def _wrapped_once(pid, snapshot, changed):
    for item in changed:
        mname, _, attr = item.partition(":")
        value = snapshot.get((mname, attr))
        if value is not None and not attr.startswith("__omni"):
            layers = wrapping.installed_by(value)
            assert layers.count(pid) <= 1, f"{item} wrapped {layers.count(pid)} times"


def _layers(snapshot, item):
    mname, _, attr = item.partition(":")
    value = snapshot.get((mname, attr))
    return wrapping.installed_by(value) if value is not None else []


def _reload(pid, mods, changed, applied):
    """``importlib.reload`` of a patched target re-executes it. Where that leaves stock code behind (a function
    or class it defines), status must not say applied (``reverted``), and ``engine.reapply`` applies it once
    more, wrapped once; what the module only imports from elsewhere stays patched, and applied. Some real
    modules cannot be executed twice in one process (a registry that refuses a second registration): then
    that is reported."""
    name = next(n for n in mods if any(c.startswith(n + ":") for c in changed))
    try:
        importlib.reload(mods[name])
    except Exception as exc:
        return f"{name} cannot be reloaded here ({type(exc).__name__}: {exc})"
    ours = [c for c in changed if c.startswith(name + ":") and pid in _layers(applied, c)]  # what carries a mark
    now = _snapshot(mods)
    stock = [c for c in ours if pid not in _layers(now, c)]
    st = _status(pid)
    if not stock:
        assert st.state == State.APPLIED, f"importlib.reload({name}) left every patched attribute in place: {st}"
        return f"{name}: reloaded, every patched attribute still in place (not defined by its code, or a loader that does not re-execute)"
    assert st.state == State.REVERTED, f"after importlib.reload({name}) {stock} are stock, status says {st.state}: " \
                                   f"{st.reason}"
    assert engine.reapply(mods[name]).get(pid) == State.APPLIED, _status(pid)
    now = _snapshot(mods)
    assert not [c for c in stock if pid not in _layers(now, c)], "reapply left stock attributes"
    _wrapped_once(pid, now, changed)
    return f"{name}: {len(stock)} attribute(s) stock after the reload: reverted, then applied again"


def _status(pid):
    return {s.id: s for s in omni_patches.status()}[pid]


def fingerprint(value):
    """A comparable, JSON-able form of a drive's result: tensors by dtype, shape and bytes."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        return ["tensor", type(value).__name__, str(t.dtype), list(t.shape),
                hashlib.sha256(bytes(data.tolist())).hexdigest()]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [fingerprint(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", sorted([repr(k), fingerprint(v)] for k, v in value.items())]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return ["object", type(value).__qualname__, repr(value)]


def _outcome(drive):
    """``("returned", result)`` or ``("raised", "Type: message")``."""
    try:
        return "returned", drive()
    except Exception as exc:
        return "raised", f"{type(exc).__name__}: {exc}"


def _unexpected(case, index, report):
    """Stock's outcome first, then patched (twice): the same outcome, and the fallback noted once."""
    item = case.unexpected[index]
    mods, missing = _import_targets(registry.load().specs[case.patch_id], item.env)
    assert mods, f"none of the targets imports in {item.env.label}: {missing}"
    stock = _outcome(item.drive)
    assert omni_patches.activate() is True
    st = _status(case.patch_id)
    assert st.state == State.APPLIED, f"the unexpected input needs the patch applied: {st.state}: {st.reason}"
    patched = [_outcome(item.drive) for _ in range(2)]
    report.update(stock=[stock[0], fingerprint(stock[1]) if stock[0] == "returned" else stock[1]])
    for kind, value in patched:
        assert kind == stock[0], f"stock {stock[0]} {stock[1] if stock[0] == 'raised' else ''}; patched {kind} " \
                                 f"{value if kind == 'raised' else ''}"
        if kind == "raised":
            assert value == stock[1], f"stock raised {stock[1]!r}, patched raised {value!r}"
        elif item.same is not None:
            assert item.same(stock[1], value), "patched result differs from stock's (case's own comparison)"
        else:
            assert fingerprint(value) == fingerprint(stock[1]), \
                f"patched result differs from stock's: {fingerprint(value)} vs {fingerprint(stock[1])}"
    reason = _status(case.patch_id).reason
    report.update(reason=reason)
    assert item.note in reason, f"{item.note!r} not noted in status: {reason!r}"
    assert reason.count(item.note) == 1, f"{item.note!r} noted {reason.count(item.note)} times: {reason!r}"


def main(case_ref, kind, index):
    asked = kind
    case = importlib.import_module(case_ref).CASE
    spec = registry.load().specs[case.patch_id]
    if kind == "affected":
        env, expect_state, reason_part = case.affected[index], State.APPLIED, ""
    elif kind == "lazy":
        env, expect_state, reason_part = case.affected[index], State.APPLIED, ""
    elif kind == "skipped":
        env, expect_state, reason_part = case.skipped[index]
    elif kind == DRIFTED_KIND:  # the kind of check, spelled like the state it expects
        (env, reason_part), expect_state = case.drifted[index], State.DRIFTED
    elif kind == "unexpected":
        env, expect_state, reason_part = case.unexpected[index].env, State.APPLIED, ""
    elif kind == "source":
        env, expect_state, reason_part = case.source_built[index]
        if expect_state == State.APPLIED:
            kind = "affected"  # the full check (applies once, undo) plus the reason
    else:
        raise SystemExit(f"unknown kind {kind}")
    sys.path[:0] = env.paths()
    zygote.verify_preloaded()  # forked from a zygote that preloaded this environment's deps: the same files
    os.environ.update(env.env)
    for other in siblings(registry.load().specs, spec):
        os.environ.setdefault(flags.env_name(other), "0")
    os.environ["OMNI_PATCHES"] = "1"
    report = {"patch": case.patch_id, "kind": asked, "env": env.label}

    if kind == "unexpected":
        _unexpected(case, index, report)
        report["ok"] = True
        print("CONTRACT " + json.dumps(report))
        return

    if kind == "lazy":
        assert omni_patches.activate() is True
        assert _status(case.patch_id).state == State.PENDING, _status(case.patch_id)
        mods, missing = _import_targets(spec, env)
        st = _status(case.patch_id)
        assert st.state == State.APPLIED, st
        report.update(applied_targets=list(st.applied_targets), not_importable=missing, ok=True)
        print("CONTRACT " + json.dumps(report))
        return

    mods, missing = _import_targets(spec, env)
    assert mods, f"none of {spec.targets} imports in {env.label}: {missing}"
    before = _snapshot(mods)
    assert omni_patches.activate() is True
    st = _status(case.patch_id)
    report.update(state=st.state, reason=st.reason, not_importable=missing)
    assert st.state == expect_state, f"expected {expect_state}, got {st.state}: {st.reason}"
    assert reason_part in st.reason, f"{reason_part!r} not in {st.reason!r}"
    applied = _snapshot(mods)
    changed = _changed(before, applied)
    if kind != "affected":
        assert not changed, f"{kind}: the patch changed {changed}"
        report["ok"] = True
        print("CONTRACT " + json.dumps(report))
        return

    assert changed, "applied but nothing in the target modules changed"
    _wrapped_once(case.patch_id, applied, changed)
    # Applies once: activation twice, and the import hook firing again, change nothing.
    assert omni_patches.activate() is False
    for name, mod in mods.items():
        engine.reapply(mod)
    again = _snapshot(mods)
    assert not _changed(applied, again), f"second application changed {_changed(applied, again)}"
    # Undo restores the identical original objects.
    assert omni_patches.unapply(case.patch_id) is True
    restored = _snapshot(mods)
    assert not _changed(before, restored), f"unapply left {_changed(before, restored)}"
    # patch -> unpatch -> patch: a new activation applies again, to the same attributes, once.
    engine.deactivate()
    assert omni_patches.activate() is True
    st = _status(case.patch_id)
    assert st.state == State.APPLIED, f"applied again after undo: {st.state}: {st.reason}"
    again = _snapshot(mods)
    assert sorted(_changed(before, again)) == sorted(changed), (changed, _changed(before, again))
    _wrapped_once(case.patch_id, again, changed)
    report["reload"] = _reload(case.patch_id, mods, changed, again)
    assert omni_patches.unapply(case.patch_id) is True
    report.update(changed=changed, ok=True)
    print("CONTRACT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
