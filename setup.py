"""One install step beyond pyproject.toml: kernel_service_tilelang.pth goes to the root of
site-packages, where Python runs its line at every start (client/tilelang_hook.py says what it
does: nothing unless KERNEL_SERVICE_TILELANG=1)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kernel_service_tilelang.pth"


class BuildWithPth(build_py):
    """build_py, plus the .pth beside the packages: in build_lib for a wheel; for an editable
    install (pip install -e), in the wheel's root, where setuptools writes files that are not
    part of the editable packages."""

    def run(self):
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(os.path.join("client", PTH), os.path.join(root, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), *([] if self.editable_mode else [os.path.join(self.build_lib, PTH)])]


setup(cmdclass={"build_py": BuildWithPth})
