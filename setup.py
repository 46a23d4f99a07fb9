"""Build script for the native kernels (everything else is declared in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("drafter_service.core._tree", ["drafter_service/core/_tree.c", "drafter_service/core/_workers.c"],
                  depends=["drafter_service/core/_workers.h"], extra_compile_args=["-O3", "-pthread"],
                  extra_link_args=["-pthread"], optional=True),
        Extension("store._kernels", ["store/_kernels.c"], extra_compile_args=["-O3"], optional=True),
        Extension("store._lru", ["store/_lru.c"], extra_compile_args=["-O3"], optional=True),
    ],
)
