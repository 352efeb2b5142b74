"""Builds the optional C core of the nvme tier (`tierkv_nvme/_batchio.c`).

It needs a C compiler and Python's headers, nothing else: the checksum (`_xxh3.c`) and
the MAC (`_blake3.c`) are the project's own. Optional: a machine without a compiler
still installs the tier, which then moves blocks on its Python path
(`tierkv_nvme.native.reason` says why). Everything else about the distribution is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierkv_nvme._batchio",
            sources=["tierkv_nvme/_batchio.c", "tierkv_nvme/_blake3.c", "tierkv_nvme/_xxh3.c"],
            depends=["tierkv_nvme/_blake3.h", "tierkv_nvme/_xxh3.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
