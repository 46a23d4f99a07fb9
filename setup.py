"""Build script for the native kernels (everything else is declared in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("store._kernels", ["store/_kernels.c"], extra_compile_args=["-O3"], optional=True),
    ],
)
