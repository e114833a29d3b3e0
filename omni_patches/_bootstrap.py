"""Start-up entry points: the ``omni_patches.pth`` line and the PEP 829 ``omni_patches.start`` file.

The .pth line returns before importing anything when OMNI_PATCHES is unset or off, so reaching
:func:`pth_hook` means the variable holds something: an "on" value activates, anything else warns once
and stays off (strict mode: and stops the host at its first vLLM-family import). If the package cannot be
imported at all (an editable install whose checkout moved), the .pth line says so in one line of its own.
Python 3.15+ ignores the .pth import line because the matching .start file exists and calls :func:`start`
instead; activation is idempotent, so an interpreter honouring both still activates once.
Nothing here may raise (unless OMNI_PATCHES_STRICT=1): a start-up hook that raises breaks every
interpreter of the environment.
"""
import os

from . import flags  # stdlib-only: the one on/off parser (the .pth line inlines its "off" words: tests compare)


def start():
    """PEP 829 entry point (``omni_patches._bootstrap:start``): same rules as the .pth line."""
    if flags.parse(os.environ.get(flags.MASTER)) is not False:
        pth_hook(source="start")


def pth_hook(source="pth"):
    try:
        value = flags.parse(os.environ.get(flags.MASTER))
        if value is None:
            from . import log

            problem = flags.master_problem(os.environ.get(flags.MASTER))
            log.once(30, ("env", problem), "%s", problem)
            if flags.strict():  # stays off, and stops the host at its first vLLM-family import
                from . import engine

                engine.strict_stop(problem)
        elif value:
            from .engine import activate

            activate(source=source)
    except Exception:
        if flags.strict():
            raise
        try:
            from . import log

            log.get().exception("omni-patches start-up failed; running unpatched")
        except Exception:
            pass
