"""The package list, derived: every folder with an __init__.py under engine/, tasks/ and flows/ is
installed as rlflow.<folder path>, and configs/ as rlflow.configs (the shipped configs and device
prices, found through `rlflow.configs.shipped_file` wherever rlflow is installed). pyproject.toml
holds everything else; setuptools cannot prefix the names `packages.find` discovers, which is why
this is code and not a list kept by hand."""

from setuptools import find_packages, setup

TOP = ("engine", "tasks", "flows", "configs")

setup(
    packages=[f"rlflow.{name}" for name in find_packages(include=[f"{top}*" for top in TOP])],
    package_dir={f"rlflow.{top}": top for top in TOP},
    package_data={"rlflow.configs": ["*.yaml"]},
)
