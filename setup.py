"""The optional C extension (``native/``); everything else is configured in pyproject.toml.

``optional=True``: where no C compiler is present the install goes on without it and DMI uses
its numpy code instead (``storage/_native.py``), which gives the same bytes.
``-ffp-contract=off``: the statistics loop must round every float64 add and multiply as numpy
does; with ``CFLAGS=-march=native`` a compiler would otherwise fuse them into FMAs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dmi.storage._native_ext",
            sources=["native/dmi_native.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
