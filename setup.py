"""The build hook: the gRPC stubs (specd/v1, git-ignored) are generated from protos/ before setuptools
collects the package, so a wheel, a wheel built from the sdist and an editable install all have them.
Everything else about the package is in pyproject.toml."""
import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

GEN_PROTOS = Path(__file__).resolve().parent / "scripts" / "gen_protos.py"
STUBS_PACKAGE = "specd.v1"


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        runpy.run_path(str(GEN_PROTOS))["generate_stubs"]()
        # On a fresh checkout the package list was found before the stubs' folder existed.
        if STUBS_PACKAGE not in self.packages:
            self.packages.append(STUBS_PACKAGE)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
