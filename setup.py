"""Maps the repository's top-level folders onto the ``hearth.*`` import namespace.

pyproject.toml holds all metadata; setuptools cannot express "install folder X as package
hearth.X" declaratively together with package discovery, so the package list is computed here.
"""

from setuptools import find_packages, setup

FOLDERS = ("app", "engine", "kernels", "offload", "resources")

packages = []
package_dir = {}
for folder in FOLDERS:
    package_dir[f"hearth.{folder}"] = folder
    for name in [folder, *(f"{folder}.{sub}" for sub in find_packages(where=folder))]:
        packages.append(f"hearth.{name}")

setup(packages=packages, package_dir=package_dir)
