# The C extensions hold the hot, bounds-checked loops (GIL released), one per subject, beside the
# Python module that uses them; everything else is metadata in pyproject.toml.
#
# Every extension is optional: each has an exact numpy (or pure-Python) fallback in the module
# that uses it (chosen at import by xarray_precomputed._native.load), so a machine without a C
# compiler or Python headers still installs a working package, only slower. A failed compile is a
# warning, not an install failure. Environment:
#   XARRAY_PRECOMPUTED_NO_EXTENSIONS=1      build no extension at all (pure install)
#   XARRAY_PRECOMPUTED_REQUIRE_EXTENSIONS=1 a failed compile fails the build (release wheels, CI)
import os
import sys
import tempfile

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools' vendored distutils (Python >= 3.12 has no stdlib distutils)
    from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError
except ImportError:  # pragma: no cover - older setuptools
    from distutils.errors import CCompilerError, CompileError, LinkError  # type: ignore
    from distutils.errors import DistutilsExecError as ExecError  # type: ignore
    from distutils.errors import DistutilsPlatformError as PlatformError  # type: ignore

BUILD_ERRORS = (CCompilerError, CompileError, LinkError, ExecError, PlatformError, OSError)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


SKIP = _flag("XARRAY_PRECOMPUTED_NO_EXTENSIONS")
REQUIRE = _flag("XARRAY_PRECOMPUTED_REQUIRE_EXTENSIONS")

# Flags per compiler family: GCC/Clang take the first, MSVC the second.
GCC_FLAGS = ["-O3", "-std=c99", "-Wall"]
MSVC_FLAGS = ["/O2", "/std:c11"]  # C11: inline, declarations after statements
GCC_ONLY_EXTRA = {"-Wno-unused-function", "-ffp-contract=off"}
# MSVC also gets, force-included (/FI), the GCC builtins the sources use outside GCC-only
# sections, as what MSVC offers: a prefetch is a hint, dropping it changes speed, never results.
MSVC_COMPAT = """\
#if defined(_MSC_VER) && !defined(__clang__)
#define __builtin_prefetch(addr, ...) ((void)(addr))
#endif
"""

ZLIB_PROBE = "#include <zlib.h>\nint main(void) { return zlibVersion() == 0; }\n"


def ext(name: str, source: str, *extra: str, include_dirs=(), uses_zlib: bool = False) -> Extension:
    e = Extension(name, sources=[source], include_dirs=[numpy.get_include(), *include_dirs])
    e._xp_extra = list(extra)  # compiler-specific flags, set in BuildExt
    e._xp_zlib = uses_zlib  # links zlib (XP_HAVE_ZLIB) when its header and library are found
    return e


class BuildExt(build_ext):
    """Compiles each extension on its own; one that cannot be compiled is reported and skipped
    (its numpy fallback is used), unless XARRAY_PRECOMPUTED_REQUIRE_EXTENSIONS is set."""

    def run(self):
        try:
            super().run()
        except BUILD_ERRORS as exc:  # no compiler at all (e.g. MSVC missing)
            if REQUIRE:
                raise
            self._warn("the extensions", exc)
            self.extensions = []

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        have_zlib = None
        if msvc:
            os.makedirs(self.build_temp, exist_ok=True)
            compat = os.path.abspath(os.path.join(self.build_temp, "xp_msvc_compat.h"))
            with open(compat, "w") as f:
                f.write(MSVC_COMPAT)
        for e in self.extensions:
            extra = getattr(e, "_xp_extra", [])
            if msvc:
                e.extra_compile_args = (MSVC_FLAGS + [f"/FI{compat}"]
                                        + [f for f in extra if f not in GCC_ONLY_EXTRA])
            else:
                e.extra_compile_args = GCC_FLAGS + list(extra)
            if getattr(e, "_xp_zlib", False):
                if have_zlib is None:
                    have_zlib = self._has_zlib()
                if have_zlib:
                    e.define_macros = [*e.define_macros, ("XP_HAVE_ZLIB", "1")]
                    e.libraries = [*e.libraries, "z"]
                else:
                    print(f"xarray-precomputed: zlib not found; {e.name} is built without gzip "
                          "(gzip chunks take the Python path)", file=sys.stderr)
        self._failed = []
        super().build_extensions()
        # what was not built is not an output: neither copied into the tree (editable and
        # --inplace builds) nor listed in the wheel
        self.extensions = [e for e in self.extensions if e not in self._failed]

    def build_extension(self, e):
        try:
            super().build_extension(e)
        except BUILD_ERRORS as exc:
            if REQUIRE:
                raise
            self._warn(e.name, exc)
            self._failed.append(e)

    def _has_zlib(self) -> bool:
        """Whether a program including zlib.h links against -lz with this compiler."""
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "zprobe.c")
            with open(src, "w") as f:
                f.write(ZLIB_PROBE)
            try:
                objs = self.compiler.compile([src], output_dir=tmp)
                self.compiler.link_executable(objs, "zprobe", output_dir=tmp, libraries=["z"])
            except BUILD_ERRORS:
                return False
        return True

    @staticmethod
    def _warn(what: str, exc: BaseException) -> None:
        line = str(exc).strip().splitlines()
        reason = line[-1] if line else type(exc).__name__
        print(f"WARNING xarray-precomputed: could not compile {what} ({reason}); the package "
              "works without it through its numpy fallback, more slowly. Install a C compiler "
              "and the Python headers (Debian: build-essential python3-dev) for the fast path.",
              file=sys.stderr)


EXTENSIONS = [
    ext("xarray_precomputed.codecs._cseg", "src/xarray_precomputed/codecs/_cseg.c",
        "-Wno-unused-function"),
    ext("xarray_precomputed.codecs._cseg_labels", "src/xarray_precomputed/codecs/_cseg_labels.c",
        "-Wno-unused-function"),
    ext("xarray_precomputed.codecs._cseg_encode", "src/xarray_precomputed/codecs/_cseg_encode.c"),
    ext("xarray_precomputed.codecs._fortran", "src/xarray_precomputed/codecs/_fortran.c"),
    ext("xarray_precomputed.codecs._fpzip", "src/xarray_precomputed/codecs/_fpzip.c"),
    ext("xarray_precomputed.codecs._crackle", "src/xarray_precomputed/codecs/_crackle.c"),
    # no fused multiply-add: dequantized positions must round as the reference decoder's do
    ext("xarray_precomputed.codecs._draco", "src/xarray_precomputed/codecs/_draco.c",
        "-ffp-contract=off"),
    ext("xarray_precomputed.dvid._block", "src/xarray_precomputed/dvid/_block.c"),
    ext("xarray_precomputed.storage._fileread", "src/xarray_precomputed/storage/_fileread.c"),
    ext("xarray_precomputed.kvstore._minishard", "src/xarray_precomputed/kvstore/_minishard.c",
        uses_zlib=True),
    ext("xarray_precomputed.reading._chunk_batch", "src/xarray_precomputed/reading/_chunk_batch.c",
        "-Wno-unused-function", include_dirs=["src/xarray_precomputed/codecs"], uses_zlib=True),
]

setup(
    ext_modules=[] if SKIP else EXTENSIONS,
    cmdclass={"build_ext": BuildExt},
)
