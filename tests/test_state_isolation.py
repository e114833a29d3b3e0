"""Runs last (tests/conftest.py orders it): the suite left the production state directory as it found it."""
import os

import conftest


def test_no_process_of_the_suite_recorded_into_the_production_directory():
    assert os.environ["OMNI_PATCHES_STATE_DIR"] == conftest.SESSION_STATE_DIR
    assert conftest.DEFAULT_STATE_DIR != conftest.SESSION_STATE_DIR
    guard = conftest.STATE_GUARD
    assert guard._thread.is_alive(), "the guard stopped watching during the session"
    guard.stop()
    leaked = guard.leaked()
    assert not leaked, f"processes of the test suite wrote into {conftest.DEFAULT_STATE_DIR}: {leaked}"


def test_the_guard_catches_a_child_that_records_into_the_production_directory(tmp_path):
    """The check above can fail: a child of this process that records into a watched directory is caught,
    a record written there by a process outside the suite is not."""
    import json
    import subprocess
    import sys

    from support.state_guard import StateGuard

    production, session = tmp_path / "production", tmp_path / "session"
    production.mkdir()
    session.mkdir()
    (production / "1.json").write_text(json.dumps({"pid": 1, "start": 1, "ppid": 0, "instance": "other"}))
    guard = StateGuard(production, session, interval=0.05).start()
    code = ("import json, os, sys, time; from support.state_guard import _stat_fields; "
            "time.sleep(0.5); pid = os.getpid(); ppid, start = _stat_fields(pid); "
            "open(os.path.join(sys.argv[1], f'{pid}.json'), 'w').write(json.dumps("
            "{'pid': pid, 'ppid': ppid, 'start': start, 'instance': 'x'}))")
    subprocess.run([sys.executable, "-c", code, str(production)], check=True,
                   env={**os.environ, "PYTHONPATH": str(conftest.TESTS)})
    (production / "2.json").write_text(json.dumps({"pid": 2, "start": 5, "ppid": 1, "instance": "stranger"}))
    guard.stop()
    leaked = guard.leaked()
    assert [r["file"] for r in leaked] != [] and all(r["file"] not in ("1.json", "2.json") for r in leaked)
    assert any("was a process of the suite" in w for r in leaked for w in r["why"])


def test_records_of_this_session_went_to_its_own_directory(tmp_path):
    """A real activation in a child records into the session directory (the mechanism the check relies on)."""
    import subprocess
    import sys

    from support.venvs import clean_env

    code = ("import omni_patches.proof as p, omni_patches.engine as e; e.activate(force=True); "
            "print(p.state_dir())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env())
    assert out.stdout.strip() == conftest.SESSION_STATE_DIR, out.stderr


def test_the_home_check_sees_an_upstream_default_made_during_the_session(tmp_path, mocker):
    """The controller's end-of-session check (conftest.home_leaks) can fail: a watched directory absent at the
    start and present now is listed; one still absent is not."""
    made, still_absent = tmp_path / "ascend", tmp_path / "vllm-omni"
    mocker.patch.object(conftest, "ABSENT_AT_START", [made, still_absent])
    assert conftest.home_leaks() == []
    (made / "log").mkdir(parents=True)
    assert conftest.home_leaks() == [str(made)]
