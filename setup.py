# The C extension holds the hot decoders (GIL released, bounds-checked); everything else is metadata
# in pyproject.toml.
import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "xarray_precomputed._native",
            sources=["src/xarray_precomputed/_native.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O3", "-std=c99", "-Wall", "-Wno-unused-function"],
        ),
        Extension(
            "xarray_precomputed._layout",
            sources=["src/xarray_precomputed/_layout.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O3", "-std=c99", "-Wall"],
        ),
    ]
)
