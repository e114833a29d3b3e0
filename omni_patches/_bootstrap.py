"""Entry point of the ``omni_patches.pth`` line (and the PEP 829 ``.start`` file).

The .pth line itself already returned early when OMNI_PATCHES is unset or off, so reaching this module
means the variable holds something: an "on" value activates, anything else warns once and stays off.
Nothing here may raise: a .pth that raises breaks every interpreter of the environment.
"""
import os


def pth_hook():
    try:
        from . import flags

        value = flags.parse(os.environ.get(flags.MASTER))
        if value is None:
            from . import log

            log.once(30, "master", "%s=%r is not 1/true/yes/on or 0/false/no/off; omni-patches stays off",
                     flags.MASTER, os.environ.get(flags.MASTER))
            return
        if value:
            from .engine import activate

            activate(source="pth")
    except Exception:
        try:
            from . import flags

            if flags.strict():
                raise
            from . import log

            log.get().exception("omni-patches start-up failed; running unpatched")
        except Exception:
            if os.environ.get("OMNI_PATCHES_STRICT", "").strip().lower() in ("1", "true", "yes", "on"):
                raise
