"""setup.cfg holds the metadata; this file exists only to place two start-up files in site-packages.

* ``omni_patches.pth``: the activation line (a no-op unless OMNI_PATCHES is set), and its PEP 829
  twin ``omni_patches.start`` for Python 3.15+, where import lines in .pth files are deprecated;
* ``patches.toml`` is copied from the repository root into the package, so the installed package
  carries the registry.

Both regular wheels (``build_py``) and PEP 660 editable wheels (``editable_wheel``) get them.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
PTH = HERE / "omni_patches" / "omni_patches.pth"
START = HERE / "omni_patches" / "omni_patches.start"  # PEP 829: Python 3.15+ calls this instead of the .pth line
STARTUP_FILES = (PTH, START)
REGISTRY = HERE / "patches.toml"


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the package maps to the source tree (registry found there); EditableWheel adds the .pth
        for f in STARTUP_FILES:
            self.copy_file(str(f), str(Path(self.build_lib, f.name)), preserve_mode=0)
        self.copy_file(str(REGISTRY), str(Path(self.build_lib, "omni_patches", "patches.toml")), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib, f.name)) for f in STARTUP_FILES]


cmdclass = {"build_py": BuildPy}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660
    pass
else:

    class EditableWheel(editable_wheel):
        """Editable installs map the package to the source tree; the .pth still has to be in site-packages."""

        def _create_wheel_file(self, bdist_wheel):
            wheel_path = super()._create_wheel_file(bdist_wheel)

            for f in STARTUP_FILES:
                _append_to_wheel(wheel_path, f.name, f.read_bytes())
            return wheel_path

    cmdclass["editable_wheel"] = EditableWheel


def _append_to_wheel(wheel_path, name, data):
    """Add a root-level file to a built wheel, keeping its RECORD consistent."""
    import base64
    import hashlib
    import zipfile

    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel_path) as zf:
        items = [(info, zf.read(info.filename)) for info in zf.infolist()]
    with zipfile.ZipFile(wheel_path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, data)
        for info, content in items:
            if info.filename.endswith(".dist-info/RECORD"):
                content = content + f"{name},sha256={digest},{len(data)}\n".encode()
            zf.writestr(info, content)


setup(cmdclass=cmdclass)
