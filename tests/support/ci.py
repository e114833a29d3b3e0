"""What a test does when it cannot get what it needs from the package index: on a developer's machine it is
skipped, loudly; under CI (``$CI`` set, as ``.ci/run`` does) it fails -- CI never passes by skipping."""
from __future__ import annotations

import os
import sys
from typing import NoReturn


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the calling test with ``reason``; under CI fail it instead. Called while an exception is being handled
    (``except ... : skip_or_fail(...)``), CI gets that exception itself, with its traceback."""
    import pytest  # only here: examples/run_default.py imports support.wheels without pytest installed

    if os.environ.get("CI"):
        exc = sys.exc_info()[1]
        if exc is not None:
            raise exc
        pytest.fail(reason)
    pytest.skip(reason)
