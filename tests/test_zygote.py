"""The contract's zygote (:mod:`omni_patches.testing.zygote`): a check forked from it ends as the same check in an
interpreter started for it alone would, a check past its time is killed, and a zygote that is gone costs nothing
but speed; `run_code` forks `python -c` the same way."""
import json
import os
import subprocess
import sys

import pytest

from omni_patches.testing import contract

SLOW_CASE = "import time\ntime.sleep(60)\n"
TORCH_CASE = """import sys
print("PRELOADED", sorted(m for m in ("torch", "numpy") if m in sys.modules))
print("MAIN", sys.modules["__main__"].__spec__.name, sys.argv[1:])
raise SystemExit(3)
"""


@pytest.fixture
def zygotes():
    z = contract.Zygotes()
    yield z
    z.close()


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


def _fresh(argv, env):
    proc = subprocess.run([sys.executable, "-m", "omni_patches.testing.child", *argv], capture_output=True, text=True,
                          env=env, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("case", ["no_such_case_module", "exiting_case"])
def test_a_forked_check_ends_as_a_fresh_interpreter_does(zygotes, tmp_path, case):
    (tmp_path / "exiting_case.py").write_text(TORCH_CASE)
    env = _env(tmp_path)
    argv = [case, "affected", "0"]
    rc, out, err = zygotes.run(argv, env, None, 120)
    fresh_rc, fresh_out, fresh_err = _fresh(argv, env)
    assert rc == fresh_rc != 0
    assert err.strip().splitlines()[-1:] == fresh_err.strip().splitlines()[-1:]  # the same error, last line
    if case == "exiting_case":
        # Run as ``python -m omni_patches.testing.child``, with torch (and numpy) already imported.
        assert "MAIN omni_patches.testing.child ['exiting_case', 'affected', '0']" in out, out
        assert "PRELOADED ['numpy', 'torch']" in out, out
        assert "PRELOADED []" in fresh_out, fresh_out


def test_a_check_past_its_time_is_killed_and_the_zygote_serves_the_next(zygotes, tmp_path):
    (tmp_path / "slow_case.py").write_text(SLOW_CASE)
    (tmp_path / "exiting_case.py").write_text(TORCH_CASE)
    env = _env(tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        zygotes.run(["slow_case", "affected", "0"], env, None, 2)
    rc, out, _ = zygotes.run(["exiting_case", "affected", "0"], env, None, 120)
    assert rc == 3 and "MAIN omni_patches.testing.child" in out


def test_a_zygote_that_is_gone_costs_only_speed(zygotes, tmp_path):
    (tmp_path / "exiting_case.py").write_text(TORCH_CASE)
    (tmp_path / "parricide_case.py").write_text("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    env = _env(tmp_path)
    assert zygotes.run(["exiting_case", "affected", "0"], env, None, 120)[0] == 3
    [proc] = zygotes._procs.values()
    proc.kill()
    proc.wait()
    assert zygotes.run(["exiting_case", "affected", "0"], env, None, 120)[0] == 3  # a dead one is replaced
    # Gone in the middle of a check: no answer; check() then runs that check in a fresh interpreter.
    assert zygotes.run(["parricide_case", "affected", "0"], env, None, 120) is None
    assert zygotes.run(["exiting_case", "affected", "0"], env, None, 120)[0] == 3


SEEN = "import os, torch; print('SEEN', os.environ.get('OMNI_TEST_MARK'), torch.get_num_threads())"


def test_children_share_a_zygote_unless_the_preload_would_differ(zygotes, tmp_path):
    """A zygote is keyed by what its preload reads: children that differ in a case knob share one and each sees
    its own value; a variable torch reads as it is imported (``OMP_NUM_THREADS``) gets a zygote of its own, so
    the child's torch is the one a fresh interpreter would have."""
    base = {**_env(tmp_path), "OMP_NUM_THREADS": "2"}
    seen = []
    for extra in ({"OMNI_TEST_MARK": "a"}, {"OMNI_TEST_MARK": "b"}, {"OMNI_TEST_MARK": "c", "OMP_NUM_THREADS": "1"}):
        env = {**base, **extra}
        rc, out, err = zygotes.run([], env, None, 120, code=SEEN)
        fresh = subprocess.run([sys.executable, "-c", SEEN], capture_output=True, text=True, env=env, timeout=120)
        assert rc == 0 and out == fresh.stdout, (out, err, fresh.stdout)
        seen.append((out.split()[1:], len(zygotes._procs)))
    assert seen == [(["a", "2"], 1), (["b", "2"], 1), (["c", "1"], 2)]


def test_check_uses_the_zygote_unless_switched_off(tmp_path, monkeypatch, mocker):
    (tmp_path / "exiting_case.py").write_text(TORCH_CASE)
    spy = mocker.spy(contract.zygotes, "run")
    fresh = mocker.spy(contract.subprocess, "run")
    for value, forked in (("1", True), ("0", False)):
        monkeypatch.setenv(contract.ZYGOTE_ENV, value)
        spy.reset_mock()
        fresh.reset_mock()
        with pytest.raises(AssertionError, match=r"rc=3"):
            contract.check("exiting_case", "affected", 0, pythonpath=[tmp_path])
        assert spy.called is forked and fresh.called is not forked


PROGRAM = """import json, os, sys
print("STATE " + json.dumps({"path": sys.path, "argv": sys.argv, "name": __name__,
                              "env": os.environ.get("OMNI_TEST_MARK"), "loaded": "torch" in sys.modules,
                              "main": sys.modules["__main__"].__dict__ is globals()}))
if len(sys.argv) > 2:
    raise ValueError(sys.argv[2])
"""


def _state(proc):
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATE ")]
    return json.loads(line[len("STATE "):])


@pytest.mark.parametrize("args", [("plain",), ("raising", "boom")])
def test_run_code_in_a_fork_is_python_c(tmp_path, args):
    """``run_code`` forks ``python -c``: the same ``sys.path`` (built from the child's own ``PYTHONPATH``: relative,
    empty and repeated entries, as the interpreter builds it), ``sys.argv``, ``__main__``, environment, exit status
    and last error line as a fresh interpreter, with torch already imported."""
    (tmp_path / "rel").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES") and k != "PYTHONPATH"}
    env.update(OMNI_TEST_MARK="x", PYTHONPATH=os.pathsep.join(["rel", str(tmp_path), "", str(tmp_path / "rel"), ""]))
    forked = contract.run_code(PROGRAM, *args, env=env, cwd=tmp_path, timeout=120)
    fresh = subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120)
    got, want = _state(forked), _state(fresh)
    assert got.pop("loaded") is True and want.pop("loaded") is False
    assert got == want and got["path"][0] == "" and got["argv"] == ["-c", *args]
    assert forked.returncode == fresh.returncode == (1 if len(args) > 1 else 0)
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]
    assert forked.args == [sys.executable, "-c", PROGRAM, *args]


def test_run_code_with_the_shim_on_at_start_runs_fresh(tmp_path, mocker):
    spy = mocker.spy(contract.zygotes, "run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES")}
    out = contract.run_code("import sys; print('torch' in sys.modules)", env={**env, "OMNI_PATCHES": "1"},
                            cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "False" and not spy.called


def test_threads_sharing_the_zygotes_each_get_their_own_answer(tmp_path, mocker):
    """A zygote answers on one pipe, in order: two threads exchanging with it at once could read each other's
    answer. Concurrent callers each get their own child's output (one forks, the others run fresh meanwhile)."""
    import concurrent.futures

    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PATCHES")}
    fresh = mocker.spy(subprocess, "run")
    code = "import sys, time; time.sleep(0.3); print('ANSWER', sys.argv[1]); raise SystemExit(int(sys.argv[1]) % 7)"
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(lambda i: contract.run_code(code, str(i), env=env, cwd=tmp_path, timeout=120), range(12)))
    for i, proc in enumerate(runs):
        assert proc.stdout.split() == ["ANSWER", str(i)] and proc.returncode == i % 7, (i, proc)
    assert 0 < fresh.call_count < 12, "some ran in the zygote, the busy ones fresh"


PRELOADED_MOD = "import os\nLOADED_BY = os.getpid()\n"
WHO_LOADED = ("import os, sys, omni_pre_mod as m; print('LOADED', m.__file__, "
              "'zygote' if m.LOADED_BY != os.getpid() else 'child')")


def test_an_extra_preload_serves_the_children_whose_path_holds_the_same_files(zygotes, tmp_path, mocker):
    """``OMNI_TESTING_PRELOAD`` (a contract ``Env.preload``): the zygote imports a deps directory's modules once;
    a child whose own path holds that directory finds them imported, from the same file. A child whose path lacks
    it, or finds another copy first, fails loudly instead of running on what a fresh interpreter would not import;
    a contract check asks for its environment's preload, where the case is imported and the environment sets
    nothing the preloaded modules read as they import."""
    deps, other = tmp_path / "deps", tmp_path / "other"
    for d in (deps, other):
        d.mkdir()
        (d / "omni_pre_mod.py").write_text(PRELOADED_MOD)
    preload = json.dumps({"paths": [str(deps)], "modules": ["omni_pre_mod"]})
    env = {**_env(tmp_path), "PYTHONPATH": str(deps), "OMNI_TESTING_PRELOAD": preload}
    rc, out, err = zygotes.run([], env, None, 120, code=WHO_LOADED)
    assert rc == 0 and out.split() == ["LOADED", str(deps / "omni_pre_mod.py"), "zygote"], (out, err)
    fresh = subprocess.run([sys.executable, "-c", WHO_LOADED], capture_output=True, text=True, env=env, timeout=120)
    assert fresh.stdout.split() == ["LOADED", str(deps / "omni_pre_mod.py"), "child"], fresh.stderr
    for path in (str(other), os.pathsep.join([str(other), str(deps)]), str(tmp_path)):
        rc, out, err = zygotes.run([], {**env, "PYTHONPATH": path}, None, 120, code=WHO_LOADED)
        assert rc == 1 and "OMNI_TESTING_PRELOAD: this zygote preloaded omni_pre_mod" in err, (path, out, err)
    assert len(zygotes._procs) == 1  # one zygote served all four

    (tmp_path / "pre_case.py").write_text(
        "from omni_patches.testing import Case, Env\n"
        f"PRE = lambda: {json.loads(preload)!r}\n"
        "CASE = Case('omni-pre', affected=[Env('x', lambda: [], preload=PRE),\n"
        "                                  Env('hf', lambda: [], {'HF_HOME': '/nowhere'}, preload=PRE)])\n")
    import importlib

    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("pre_case")
        run = mocker.patch.object(contract.zygotes, "run", return_value=(0, 'CONTRACT {"ok": true}\n', ""))
        assert contract.check("pre_case", "affected", 0, pythonpath=[tmp_path])["ok"]
        assert run.call_args.args[1]["OMNI_TESTING_PRELOAD"] == json.dumps(json.loads(preload), sort_keys=True)
        contract.check("pre_case", "affected", 1, pythonpath=[tmp_path])  # sets what transformers reads at import
        assert "OMNI_TESTING_PRELOAD" not in run.call_args.args[1]
        del sys.modules["pre_case"]  # not imported here: no preload asked
        contract.check("pre_case", "affected", 0, pythonpath=[tmp_path])
        assert "OMNI_TESTING_PRELOAD" not in run.call_args.args[1]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pre_case", None)
