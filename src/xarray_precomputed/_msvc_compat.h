/* Force-included (/FI) by setup.py when the compiler is MSVC: GCC builtins that the C sources use
 * outside their GCC-only sections, as what MSVC offers. Nothing here for GCC or Clang. */
#ifndef XP_MSVC_COMPAT_H
#define XP_MSVC_COMPAT_H
#if defined(_MSC_VER) && !defined(__clang__)
/* a prefetch is a hint: dropping it changes speed, never results */
#define __builtin_prefetch(addr, ...) ((void)(addr))
#endif
#endif
