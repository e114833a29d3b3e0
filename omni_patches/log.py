"""The ``omni_patches`` logger: one INFO line per patch decision, DEBUG for details, each problem once."""
import logging
import os
import sys

NAME = "omni_patches"
LEVEL_VAR = "OMNI_PATCHES_LOG_LEVEL"
_seen = set()
_configured = False


def parse_level(raw):
    """``OMNI_PATCHES_LOG_LEVEL``'s value as a logging level (unset: INFO), or None when it is not one."""
    if raw is None:
        return logging.INFO
    text = raw.strip().upper()
    level = int(text) if text.isdigit() else logging.getLevelName(text)
    return level if isinstance(level, int) else None


def level_problem(environ=os.environ):
    """The message for an invalid ``OMNI_PATCHES_LOG_LEVEL``, or None (also used by ``status``/strict mode)."""
    raw = environ.get(LEVEL_VAR)
    if raw is None or parse_level(raw) is not None:
        return None
    from .flags import shown

    return f"{LEVEL_VAR}={shown(raw)} is not a logging level (DEBUG/INFO/WARNING/ERROR or a number): using INFO"


def get():
    """The logger, configured from ``OMNI_PATCHES_LOG_LEVEL`` the first time."""
    if not _configured:
        return configure()
    return logging.getLogger(NAME)


def configure():
    """Set the logger's level from ``OMNI_PATCHES_LOG_LEVEL`` now (and give it a stderr handler if it has none):
    :func:`get` does it once; a test that changes the variable calls it again."""
    global _configured
    _configured = True
    logger = logging.getLogger(NAME)
    level = parse_level(os.environ.get(LEVEL_VAR))
    logger.setLevel(logging.INFO if level is None else level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s omni-patches[%(process)d] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    problem = level_problem()
    if problem:  # the same text as the environment report at start-up: logged once between them
        once(logging.WARNING, ("env", problem), "%s", problem)
    return logger


def once(level, key, msg, *args, **kwargs):
    """Log ``msg`` the first time ``key`` (or the same text) is seen in this process; return whether it was logged.

    Keyed by text too, so one problem found on two paths (the environment report at start-up and the code
    that reads the variable later) is one line.
    """
    try:
        text = msg % args if args else msg
    except Exception:  # pragma: no cover - a bad format is the logger's to report
        text = None
    if key in _seen or (text is not None and ("text", text) in _seen):
        return False
    _seen.add(key)
    if text is not None:
        _seen.add(("text", text))
    get().log(level, msg, *args, **kwargs)
    return True


class muted:
    """``with log.muted():`` nothing is logged, and what ``once`` saw meanwhile is forgotten after (a dry run
    such as ``omni-patches audit`` logs like a real start would; it reports instead, and leaves no trace)."""

    def __enter__(self):
        self._seen, self._was = set(_seen), get().disabled
        get().disabled = True
        return self

    def __exit__(self, *exc):
        get().disabled = self._was
        _seen.clear()
        _seen.update(self._seen)
        return False


def forget():
    """Forget every message ``once`` logged (tests: each starts with a clean slate)."""
    _seen.clear()
