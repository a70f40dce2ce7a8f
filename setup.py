"""Packages of the wheel, found rather than listed: the repository root is the package
`pipeplan` (pyproject.toml's package-dir), so every folder below it with an __init__.py
becomes `pipeplan.<folder>` (a hand list once left two folders out of the wheel)."""
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "build", "build.*", "docs", "scripts"]


class BuildPy(build_py):
    """The package's modules, less this file (it sits in the package's folder)."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir)
                if not (package == "pipeplan" and m[1] == "setup")]


setup(packages=["pipeplan"] + [f"pipeplan.{p}" for p in find_packages(".", exclude=NOT_SHIPPED)],
      cmdclass={"build_py": BuildPy})
