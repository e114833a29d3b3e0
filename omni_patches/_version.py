"""omni-patches' version: a module of its own, so that the process record (:mod:`.proof`) can read it without
importing the package's public front (whose calls import the engine)."""
__version__ = "0.1.0"
