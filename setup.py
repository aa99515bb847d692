"""The one build step pyproject.toml cannot declare: the patch series (patches/, kept at the top of the
repository) copied into the package as ``ggmoe/_patches/`` so that ``ggmoe engine build`` finds it in an
installed ggmoe. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithPatches(build_py):
    def run(self) -> None:
        super().run()
        dst = Path(self.build_lib) / "ggmoe" / "_patches"
        dst.mkdir(parents=True, exist_ok=True)
        patches = sorted((ROOT / "patches").glob("*.patch"))
        if not patches:
            raise SystemExit("setup.py: no patches/*.patch to package (build from a clone or its sdist)")
        for p in patches:
            shutil.copy2(p, dst / p.name)


setup(cmdclass={"build_py": BuildPyWithPatches})
