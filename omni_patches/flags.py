"""Environment switches. Stdlib-only and cheap: this runs at interpreter start-up."""
import os

MASTER = "OMNI_PATCHES"
PREFIX = "OMNI_PATCHES_"
# Settings that share the prefix but are not patch switches.
SETTINGS = {
    "OMNI_PATCHES_CONFIG": "extra registry file(s), os.pathsep-separated, overlaid on the built-in one",
    "OMNI_PATCHES_STRICT": "1 turns every patch failure into an exception (default: log and run unpatched)",
    "OMNI_PATCHES_LOG_LEVEL": "level of the omni_patches logger (default INFO)",
    "OMNI_PATCHES_STATE_DIR": "per-instance directory where each process records what it patched",
    "OMNI_PATCHES_ASSUME_VERSION": "dist=version[,dist=version...]: gate on these versions instead of the installed ones",
    "OMNI_PATCHES_INSTANCE": "serving-instance id carried to every process (set by the first process that activates)",
    "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL": "auto|addmm|fp32: kernel of lora-cpu-fused-delta (default auto)",
}

ON_WORDS = frozenset(("1", "true", "yes", "on"))
OFF_WORDS = frozenset(("", "0", "false", "no", "off"))  # the .pth line inlines these (tests/test_engine.py checks)


SHOWN = 200  # characters of a value quoted in a message: a 100 KB variable must not flood every log line


def shown(value, limit=SHOWN):
    """``repr(value)``, cut to ``limit`` characters with the full length said: what messages quote."""
    if value is None or len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def parse(value):
    """'1'/'true'/'yes'/'on' -> True, unset/'0'/'false'/'no'/'off' -> False, anything else -> None."""
    if value is None:
        return False
    v = value.strip().lower()
    if v in ON_WORDS:
        return True
    if v in OFF_WORDS:
        return False
    return None


def master_problem(raw):
    """The message for an invalid ``OMNI_PATCHES`` value (the .pth line's warning, status, strict mode)."""
    return f"{MASTER}={shown(raw)} is not 1/true/yes/on or 0/false/no/off: omni-patches stays off"


def env_name(patch_id):
    """``lora-accel-delta`` -> ``OMNI_PATCHES_LORA_ACCEL_DELTA``."""
    return PREFIX + patch_id.upper().replace("-", "_")


def master_enabled(environ=os.environ):
    return parse(environ.get(MASTER)) is True


def strict(environ=os.environ):
    return parse(environ.get("OMNI_PATCHES_STRICT")) is True


def patch_switch(patch_id, default, environ=os.environ):
    """Return (enabled, reason) for one patch's own switch."""
    name = env_name(patch_id)
    raw = environ.get(name)
    if raw is None:
        return bool(default), ("on by default" if default else f"off by default; set {name}=1 to enable")
    value = parse(raw)
    if value is None:
        return False, f"invalid value {shown(raw)} for {name} (use 1/0, true/false, yes/no, on/off); treated as off"
    return value, f"{name}={raw}"


def unknown_names(patch_ids, environ=os.environ):
    """``OMNI_PATCHES_*`` variables that name neither a setting nor a patch, with the closest valid name."""
    known = set(SETTINGS)
    known.update(env_name(p) for p in patch_ids)
    odd = [k for k in environ if k.startswith(PREFIX) and k not in known]
    if not odd:
        return []
    import difflib

    out = []
    for name in sorted(odd):
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        out.append((name, close[0] if close else None))
    return out
