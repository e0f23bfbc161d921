"""CloudVolume's own encodings (crackle, fpzip, kempressed, zfpc): our reads against CloudVolume's,
on the same volumes, written by CloudVolume.

    python benchmarks/bench_cloudvolume_encodings.py [--root DIR] [--repeat N]

Volumes (256x256x128, chunks 128x128x64: 8 chunks of 1M voxels; chunk files stored uncompressed,
`compress=False`, so the decoders are what is timed):

- `crackle`: the FIB-25 64^3 ground-truth cube tiled and relabelled (benchmarks/volumes.py),
  uint64;
- `fpzip`: EM-like smoothed noise as float32 in [0, 1];
- `kempressed`: three float32 channels (affinity-like: the EM image shifted along each axis);
- `zfpc`: the fpzip volume's data, lossless (reversible) and with `zfpc_tolerance` 0.01.

Tables:

1. Full read of the scale, best of N: ours (`Volume.open(url).scale(0).read()`, its thread pool
   over chunks) and CloudVolume's (`cv[cv.bounds]`, `parallel=1`: its own thread pool fetches,
   decoding in the calling thread). MB/s of decoded output and the ratio ours / CloudVolume.
2. One chunk, one thread, best of N: the package's own decode call (what CloudVolume calls) and
   our `decode_into` into a C-ordered array (header checks, then our C decoders for crackle and
   fpzip/kempressed, the zfpc package's for zfpc, and the copy into the caller's array).
3. Crackle random access, one chunk: a z range of 1 and of 8 slices of 64 decoded alone
   (`decode_into` with that origin) against decoding the whole chunk; the chunk's label set
   (`codecs.crackle.labels_of`) against `np.unique` of the decoded chunk.

Imports happen before any clock starts; every read is checked equal to CloudVolume's first.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from volumes import em_like, fib25_tiles  # noqa: E402

SHAPE = (256, 256, 128)
CHUNK = (128, 128, 64)


def build(root: Path) -> dict[str, str]:
    from cloudvolume import CloudVolume

    em = em_like(SHAPE).astype(np.float32) / np.float32(255)
    volumes = {
        "crackle": ("crackle", fib25_tiles(SHAPE)[..., None], {}),
        "fpzip": ("fpzip", em[..., None], {}),
        "kempressed": ("kempressed", np.stack([em, np.roll(em, 1, 0), np.roll(em, 1, 1)], -1),
                       {}),
        "zfpc": ("zfpc", em[..., None], {}),
        "zfpc-tol0.01": ("zfpc", em[..., None], {"zfpc_tolerance": 0.01}),
    }
    urls = {}
    for name, (encoding, data, extra) in volumes.items():
        url = f"file://{root}/{name}"
        urls[name] = url
        if (root / name / "info").exists():
            continue
        info = CloudVolume.create_new_info(
            num_channels=data.shape[3], layer_type="segmentation" if name == "crackle" else "image",
            data_type=data.dtype.name, encoding=encoding, resolution=[8, 8, 8],
            voxel_offset=[0, 0, 0], chunk_size=list(CHUNK), volume_size=list(SHAPE))
        info["scales"][0].update(extra)
        vol = CloudVolume(url, info=info, compress=False, progress=False)
        vol.commit_info()
        vol[vol.bounds] = np.asfortranarray(data)
    return urls


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def full_reads(urls, repeat):
    from cloudvolume import CloudVolume

    from xarray_precomputed import Volume

    print("\n1. full read, best of", repeat)
    print(f"{'volume':14s} {'MB':>6s} {'ours MB/s':>10s} {'CV MB/s':>9s} {'ours/CV':>8s}")
    for name, url in urls.items():
        cv = CloudVolume(url, progress=False, parallel=1)
        theirs = np.asarray(cv[cv.bounds])
        scale = Volume.open(url).scale(0)
        ours = scale.read()
        assert ours.dtype == theirs.dtype and np.array_equal(
            ours.view(f"u{ours.dtype.itemsize}"), theirs.view(f"u{theirs.dtype.itemsize}")), name
        mb = ours.nbytes / 1e6
        t_ours = best(scale.read, repeat)
        t_cv = best(lambda cv=cv: cv[cv.bounds], repeat)
        print(f"{name:14s} {mb:6.0f} {mb / t_ours:10.0f} {mb / t_cv:9.0f} "
              f"{t_cv / t_ours:8.2f}")


def chunk_bytes(url: str) -> tuple[bytes, tuple]:
    path = Path(url[len("file://"):]) / "8_8_8" / "0-128_0-128_0-64"
    return path.read_bytes(), CHUNK


def one_chunk(urls, repeat):
    import crackle
    import fpzip
    import zfpc

    from xarray_precomputed.codecs import get_decoder
    from xarray_precomputed.format.info import parse_info

    print("\n2. one chunk (128x128x64), one thread, best of", repeat)
    print(f"{'volume':14s} {'package MB/s':>13s} {'ours MB/s':>10s} {'ours/package':>13s}")
    package = {"crackle": lambda b: crackle.decompress(b, parallel=1),
               "fpzip": lambda b: fpzip.decompress(b, order="F"),
               "kempressed": lambda b: np.swapaxes(fpzip.decompress(b, order="F"), 3, 2) - 2.0,
               "zfpc": zfpc.decompress}
    for name, url in urls.items():
        info = parse_info((Path(url[len("file://"):]) / "info").read_text())
        encoding = info.scales[0].encoding
        blob, shape = chunk_bytes(url)
        out = np.empty((*shape, info.num_channels), info.dtype)
        decode = get_decoder(encoding)

        def ours(decode=decode, blob=blob, out=out, shape=shape, info=info, name=name):
            decode(blob, out, chunk_shape=shape, origin=(0, 0, 0), scale=info.scales[0],
                   dtype=info.dtype, num_channels=info.num_channels, chunk=name)

        ours()
        mb = out.nbytes / 1e6
        t_pkg = best(lambda fn=package[encoding], blob=blob: fn(blob), repeat)
        t_ours = best(ours, repeat)
        print(f"{name:14s} {mb / t_pkg:13.0f} {mb / t_ours:10.0f} {t_pkg / t_ours:13.2f}")


def crackle_random_access(urls, repeat):
    from xarray_precomputed.codecs import get_decoder
    from xarray_precomputed.codecs.crackle import labels_of

    blob, shape = chunk_bytes(urls["crackle"])
    decode = get_decoder("crackle")
    dt = np.dtype("uint64")
    full = np.empty((*shape, 1), dt)

    def read(z0, nz, out):
        decode(blob, out, chunk_shape=shape, origin=(0, 0, z0), scale=None, dtype=dt,
               num_channels=1, chunk="c")

    read(0, 64, full)
    print("\n3. crackle random access, one 128x128x64 uint64 chunk, one thread, best of", repeat)
    t_full = best(lambda: read(0, 64, full), repeat)
    print(f"{'whole chunk':28s} {t_full * 1e3:8.2f} ms")
    for nz in (1, 8):
        part = np.empty((128, 128, nz, 1), dt)
        read(30, nz, part)
        assert np.array_equal(part, full[:, :, 30:30 + nz])
        t = best(lambda nz=nz, part=part: read(30, nz, part), repeat)
        print(f"{f'z range of {nz}':28s} {t * 1e3:8.2f} ms  ({t_full / t:.1f}x faster)")
    got = labels_of(blob, chunk_shape=shape, dtype=dt, chunk="c")
    assert np.array_equal(got, np.unique(full))
    t_labels = best(lambda: labels_of(blob, chunk_shape=shape, dtype=dt, chunk="c"), repeat)
    t_unique = best(lambda: (read(0, 64, full), np.unique(full)), repeat)
    print(f"{'label set (labels_of)':28s} {t_labels * 1e3:8.2f} ms  ({t_unique / t_labels:.1f}x "
          f"faster than decode + np.unique, {t_unique * 1e3:.1f} ms; {got.size} labels)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/bench_cloudvolume_encodings"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    # imports before any clock: CloudVolume, the decoders, ours, dask (our reader's pool)
    import cloudvolume  # noqa: F401
    import crackle  # noqa: F401
    import fpzip  # noqa: F401
    import zfpc  # noqa: F401

    import xarray_precomputed  # noqa: F401

    args.root.mkdir(parents=True, exist_ok=True)
    urls = build(args.root)
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"numpy {np.__version__}, cloud-volume {cloudvolume.__version__}")
    full_reads(urls, args.repeat)
    one_chunk(urls, args.repeat)
    crackle_random_access(urls, args.repeat)


if __name__ == "__main__":
    main()
