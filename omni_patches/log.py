"""The ``omni_patches`` logger: one INFO line per patch decision, DEBUG for details, each problem once."""
import logging
import os
import sys

NAME = "omni_patches"
_seen = set()
_configured = False


def get():
    global _configured
    logger = logging.getLogger(NAME)
    if not _configured:
        _configured = True
        raw = os.environ.get("OMNI_PATCHES_LOG_LEVEL", "INFO").strip().upper()
        level = int(raw) if raw.isdigit() else logging.getLevelName(raw)
        bad = not isinstance(level, int)
        logger.setLevel(logging.INFO if bad else level)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s omni-patches[%(process)d] %(levelname)s %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        if bad:
            logger.warning("OMNI_PATCHES_LOG_LEVEL=%r is not a logging level; using INFO", raw)
    return logger


def once(level, key, msg, *args, **kwargs):
    """Log ``msg`` the first time ``key`` is seen in this process; return whether it was logged."""
    if key in _seen:
        return False
    _seen.add(key)
    get().log(level, msg, *args, **kwargs)
    return True
