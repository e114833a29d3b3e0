"""Runs last (tests/conftest.py orders it): the suite left the production state directory as it found it."""
import os

import conftest


def test_default_state_directory_is_untouched_by_the_suite():
    assert os.environ["OMNI_PATCHES_STATE_DIR"] == conftest.SESSION_STATE_DIR
    assert conftest.DEFAULT_STATE_DIR != conftest.SESSION_STATE_DIR
    after = conftest.state_fingerprint(conftest.DEFAULT_STATE_DIR)
    assert after == conftest.DEFAULT_STATE_BEFORE, (
        f"the test suite wrote into the production state directory {conftest.DEFAULT_STATE_DIR}: "
        f"before {conftest.DEFAULT_STATE_BEFORE}, after {after}")


def test_records_of_this_session_went_to_its_own_directory(tmp_path):
    """A real activation in a child records into the session directory (the mechanism the check relies on)."""
    import subprocess
    import sys

    from support.venvs import clean_env

    code = ("import omni_patches.proof as p, omni_patches.engine as e; e.activate(force=True); "
            "print(p.state_dir())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env())
    assert out.stdout.strip() == conftest.SESSION_STATE_DIR, out.stderr
