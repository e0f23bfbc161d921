# The C extensions hold the hot, bounds-checked loops (GIL released), one per subject, beside the
# Python module that uses them; everything else is metadata in pyproject.toml.
import numpy
from setuptools import Extension, setup


def ext(name: str, source: str, *extra: str) -> Extension:
    return Extension(name, sources=[source], include_dirs=[numpy.get_include()],
                     extra_compile_args=["-O3", "-std=c99", "-Wall", *extra])


setup(
    ext_modules=[
        ext("xarray_precomputed.codecs._cseg", "src/xarray_precomputed/codecs/_cseg.c",
            "-Wno-unused-function"),
        ext("xarray_precomputed.codecs._cseg_encode", "src/xarray_precomputed/codecs/_cseg_encode.c"),
        ext("xarray_precomputed.codecs._fortran", "src/xarray_precomputed/codecs/_fortran.c"),
        ext("xarray_precomputed.dvid._block", "src/xarray_precomputed/dvid/_block.c"),
        ext("xarray_precomputed.storage._fileread", "src/xarray_precomputed/storage/_fileread.c"),
    ]
)
