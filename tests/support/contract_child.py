"""One contract check in a fresh interpreter: ``python -m support.contract_child <case> <kind> <index>``."""
import hashlib
import importlib
import json
import os
import sys

import omni_patches
from omni_patches import engine, registry, wrapping


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
    assert st.state == "applied", f"the unexpected input needs the patch applied: {st.state}: {st.reason}"
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


def main(case_module, kind, index):
    asked = kind
    case = importlib.import_module(f"patches.{case_module}.case").CASE
    spec = registry.load().specs[case.patch_id]
    if kind == "affected":
        env, expect_state, reason_part = case.affected[index], "applied", ""
    elif kind == "lazy":
        env, expect_state, reason_part = case.affected[index], "applied", ""
    elif kind == "skipped":
        env, expect_state, reason_part = case.skipped[index]
    elif kind == "drifted":
        (env, reason_part), expect_state = case.drifted[index], "drifted"
    elif kind == "unexpected":
        env, expect_state, reason_part = case.unexpected[index].env, "applied", ""
    elif kind == "source":
        env, expect_state, reason_part = case.source_built[index]
        if expect_state == "applied":
            kind = "affected"  # the full check (applies once, undo) plus the reason
    else:
        raise SystemExit(f"unknown kind {kind}")
    sys.path[:0] = env.paths()
    os.environ.update(env.env)
    os.environ["OMNI_PATCHES"] = "1"
    report = {"patch": case.patch_id, "kind": asked, "env": env.label}

    if kind == "unexpected":
        _unexpected(case, index, report)
        report["ok"] = True
        print("CONTRACT " + json.dumps(report))
        return

    if kind == "lazy":
        assert omni_patches.activate() is True
        assert _status(case.patch_id).state == "pending", _status(case.patch_id)
        mods, missing = _import_targets(spec, env)
        st = _status(case.patch_id)
        assert st.state == "applied", st
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
    for item in changed:
        mname, _, attr = item.partition(":")
        value = applied.get((mname, attr))
        if value is not None and not attr.startswith("__omni"):
            layers = wrapping.installed_by(value)
            assert layers.count(case.patch_id) <= 1, f"{item} wrapped {layers.count(case.patch_id)} times"
    # Applies once: activation twice, and the import hook firing again, change nothing.
    assert omni_patches.activate() is False
    for name, mod in mods.items():
        engine._on_import(engine._state.generation, case.patch_id, name, mod)
    again = _snapshot(mods)
    assert not _changed(applied, again), f"second application changed {_changed(applied, again)}"
    # Undo restores the identical original objects.
    assert omni_patches.unapply(case.patch_id) is True
    restored = _snapshot(mods)
    assert not _changed(before, restored), f"unapply left {_changed(before, restored)}"
    report.update(changed=changed, ok=True)
    print("CONTRACT " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
