"""Candidate decoders for the `jpeg`, `png` and `jxl` encodings: speed, and behaviour on corrupt input.
Also `compresso`: the package's decoder alone, and behind this project's stream checks.

    python benchmarks/bench_image_decoders.py [--repeat N] [--fuzz N]

Input: one 64x64x64 chunk of smooth, noisy EM-like uint8 data laid out the way TensorStore writes
it (an image of width x = 64 and height y*z = 4096), grey and 3-channel; uint16 for png; for
compresso a 64^3 uint32 label chunk of overlapping balls. Speed is MB/s of decoded output, best
of 5, for one thread and for two threads decoding at once (aggregate; shows whether the decoder
releases the GIL, which the reader's thread pool relies on).

Robustness (`--fuzz N`, default 300): each decoder gets N mutated copies of its input (truncated,
bit-flipped, header bytes overwritten, a run of random bytes) in a child process under a 4 GiB
address-space limit; the table counts inputs rejected with an exception, inputs accepted (decoded
to *something*: silent garbage), and whether the process died (segfault/abort). Candidates that
are not installed are listed as such. No assertions: it prints tables.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np

SHAPE = (64, 64, 64)


def make_images():
    rng = np.random.default_rng(0)
    x, y, z = SHAPE
    g = np.mgrid[0:x, 0:y, 0:z].astype(np.float32)
    base = 128 + 60 * np.sin(g[0] / 7) * np.cos(g[1] / 11) + 30 * np.sin(g[2] / 5)
    vol = np.clip(base + rng.normal(0, 12, SHAPE), 0, 255).astype(np.uint8)
    # the image TensorStore writes: rows are x, Fortran flattening of [x, y, z] -> (y*z, x)
    gray = np.ascontiguousarray(vol.transpose(2, 1, 0).reshape(y * z, x))
    rgb = np.ascontiguousarray(np.stack([gray, 255 - gray, gray // 2], axis=-1))
    gray16 = (gray.astype(np.uint16) * 257) ^ rng.integers(0, 64, gray.shape, dtype=np.uint16)
    return {"gray8": gray, "rgb8": rgb, "gray16": gray16}


def make_labels():
    rng = np.random.default_rng(1)
    labels = np.zeros(SHAPE, np.uint32)
    g = np.ogrid[0:SHAPE[0], 0:SHAPE[1], 0:SHAPE[2]]
    for i in range(40):
        c = rng.integers(0, 64, 3)
        r = rng.integers(4, 20)
        labels[(g[0] - c[0]) ** 2 + (g[1] - c[1]) ** 2 + (g[2] - c[2]) ** 2 < r * r] = i + 1
    return labels


def encoded_inputs():
    import imagecodecs

    imgs = make_images()
    out = {
        "jpeg gray": imagecodecs.jpeg8_encode(imgs["gray8"], level=80),
        "jpeg rgb": imagecodecs.jpeg8_encode(imgs["rgb8"], level=80),
        "png gray8": imagecodecs.png_encode(imgs["gray8"], level=6),
        "png rgb8": imagecodecs.png_encode(imgs["rgb8"], level=6),
        "png gray16": imagecodecs.png_encode(imgs["gray16"], level=6),
    }
    try:
        import compresso

        out["compresso u32"] = compresso.compress(make_labels())
    except ImportError:
        pass
    if imagecodecs.JPEGXL.available:
        out["jxl gray lossless"] = imagecodecs.jpegxl_encode(imgs["gray8"], lossless=True)
        out["jxl rgb q85"] = imagecodecs.jpegxl_encode(imgs["rgb8"], level=85)
    return out


def candidates():
    """name -> (formats it decodes, factory(data, label) -> zero-argument decode callable)."""
    c = {}
    try:
        import simplejpeg

        def sj(data, label):
            cs = "GRAY" if "gray" in label else "RGB"
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            buf = np.empty((h, w, 1 if cs == "GRAY" else 3), np.uint8)
            return lambda: simplejpeg.decode_jpeg(data, colorspace=cs, buffer=buf, strict=True)
        c["simplejpeg"] = ("jpeg", sj)
    except ImportError:
        c["simplejpeg"] = ("jpeg", None)
    try:
        import imagecodecs

        c["imagecodecs.jpeg8"] = ("jpeg", lambda d, _: lambda: imagecodecs.jpeg8_decode(d))
        c["imagecodecs.png"] = ("png", lambda d, _: lambda: imagecodecs.png_decode(d))
        c["imagecodecs.spng"] = ("png", lambda d, _: lambda: imagecodecs.spng_decode(d))
        c["imagecodecs.jpegxl"] = ("jxl", lambda d, _: lambda: imagecodecs.jpegxl_decode(d))
    except ImportError:
        for n, f in (("jpeg8", "jpeg"), ("png", "png"), ("spng", "png"), ("jpegxl", "jxl")):
            c[f"imagecodecs.{n}"] = (f, None)
    try:
        import compresso

        from xarray_precomputed.codecs.compresso import decode_into

        def checked(data, _):
            out = np.empty(SHAPE + (1,), np.uint32)
            return lambda: decode_into(data, out, chunk_shape=SHAPE, origin=(0, 0, 0), scale=None,
                                       dtype=np.dtype(np.uint32), num_channels=1, chunk="bench")
        c["compresso (unchecked)"] = ("compresso", lambda d, _: lambda: compresso.decompress(d))
        c["compresso + checks"] = ("compresso", checked)
    except ImportError:
        c["compresso"] = ("compresso", None)
    try:
        import pyspng  # either pyspng (nurpax) or pyspng-seunglab: same module name

        name = "pyspng-seunglab" if hasattr(pyspng, "header") else "pyspng"
        c[name] = ("png", lambda d, _: lambda: pyspng.load(d))
    except ImportError:
        c["pyspng"] = ("png", None)
    return c


def rate(fn, nbytes, threads, repeat):
    fn()
    best = 0.0
    for _ in range(5):
        barrier = threading.Barrier(threads + 1)

        def work():
            barrier.wait()
            for _ in range(repeat):
                fn()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        best = max(best, nbytes * repeat * threads / dt / 1e6)
    return best


FUZZ_CHILD = r"""
import sys, resource, numpy as np
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
sys.path.insert(0, {bench_dir!r})
import bench_image_decoders as b
name, label, n = {name!r}, {label!r}, {n}
data = b.encoded_inputs()[label]
make = b.candidates()[name][1]
rejected = accepted = 0
for seed in range(n):
    r = np.random.default_rng(seed)
    buf = bytearray(data)
    kind = seed % 4
    if kind == 0:
        buf = buf[: int(r.integers(0, len(buf)))]
    elif kind == 1:
        for _ in range(int(r.integers(1, 8))):
            i = int(r.integers(0, len(buf))); buf[i] ^= 1 << int(r.integers(0, 8))
    elif kind == 2:
        for _ in range(int(r.integers(1, 4))):
            buf[int(r.integers(0, min(64, len(buf))))] = int(r.integers(0, 256))
    else:
        i = int(r.integers(0, len(buf))); k = int(r.integers(1, 32))
        buf[i:i + k] = r.integers(0, 256, len(buf[i:i + k]), dtype=np.uint8).tobytes()
    try:
        make(bytes(buf), label)()
        accepted += 1
    except Exception:
        rejected += 1
print(rejected, accepted)
"""


def fuzz(name, label, n):
    code = FUZZ_CHILD.format(bench_dir=os.path.dirname(os.path.abspath(__file__)), name=name,
                             label=label, n=n)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return f"CRASHED (exit {p.returncode})"
    rejected, accepted = p.stdout.split()
    return f"{rejected} rejected, {accepted} accepted"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--fuzz", type=int, default=300, help="mutated inputs per decoder; 0 skips")
    args = ap.parse_args()
    inputs = encoded_inputs()
    imgs = make_images()
    decoded_bytes = {"gray": imgs["gray8"].nbytes, "rgb": imgs["rgb8"].nbytes,
                     "compresso": 4 * imgs["gray8"].nbytes}
    cands = candidates()

    print(f"chunk {SHAPE}, image {SHAPE[0]} x {SHAPE[1] * SHAPE[2]}; MB/s of decoded output")
    print(f"{'input':<20}{'bytes':>8}  {'decoder':<24}{'1 thread':>10}{'2 threads':>11}")
    for label, data in inputs.items():
        fmt = label.split()[0]
        nbytes = (decoded_bytes["compresso"] if fmt == "compresso" else
                  decoded_bytes["rgb" if "rgb" in label else "gray"] * (2 if "16" in label else 1))
        for name, (f, make) in cands.items():
            if f != fmt:
                continue
            if make is None:
                print(f"{label:<20}{len(data):>8}  {name:<24}{'not installed':>21}")
                continue
            try:
                fn = make(data, label)
                r1 = rate(fn, nbytes, 1, args.repeat)
                r2 = rate(fn, nbytes, 2, args.repeat)
            except Exception as e:  # e.g. a decoder without 16-bit support
                print(f"{label:<20}{len(data):>8}  {name:<24}  fails: {type(e).__name__}: {e}")
                continue
            print(f"{label:<20}{len(data):>8}  {name:<24}{r1:>10.0f}{r2:>11.0f}")

    if args.fuzz:
        print(f"\ncorrupt input: {args.fuzz} mutated copies each, in a child process")
        for label in inputs:
            fmt = label.split()[0]
            for name, (f, make) in cands.items():
                if f == fmt and make is not None:
                    print(f"{label:<20}{name:<24}{fuzz(name, label, args.fuzz)}")


if __name__ == "__main__":
    main()
