"""What an export reports (`ExportReport`, one `ArrayReport` per array) and its progress bar."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

__all__ = ["ArrayReport", "ExportReport", "Progress", "progress_callback"]


@dataclass
class ArrayReport:
    name: str
    shape: tuple[int, ...]          # zarr order
    chunks: tuple[int, ...]
    shards: tuple[int, ...]
    n_shards: int = 0
    written: int = 0
    skipped: int = 0                 # already complete and verified
    bytes_in: int = 0                # uncompressed bytes of the shards written now
    bytes_stored: int = 0            # stored bytes of all shards of the array


@dataclass
class ExportReport:
    store: str
    arrays: list[ArrayReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def written(self) -> int:
        return sum(a.written for a in self.arrays)

    @property
    def skipped(self) -> int:
        return sum(a.skipped for a in self.arrays)

    @property
    def bytes_in(self) -> int:
        return sum(a.bytes_in for a in self.arrays)

    def __str__(self) -> str:
        lines = [f"OME-Zarr 0.5 written to {self.store} in {self.seconds:.1f} s"]
        for a in self.arrays:
            lines.append(
                f"  {a.name}: shape {list(a.shape)}, inner chunk {list(a.chunks)}, shard "
                f"{list(a.shards)}; {a.n_shards} shards: {a.written} written, {a.skipped} "
                f"already complete; {human(a.bytes_stored)} stored")
        if self.seconds > 0 and self.bytes_in:
            lines.append(f"  {human(self.bytes_in)} of voxels converted, "
                         f"{self.bytes_in / self.seconds / 1e6:.1f} MB/s")
        return "\n".join(lines)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


class Progress:
    """Shards written so far, on stderr: tqdm when installed, else one rewritten line."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="shard", desc="converting", file=sys.stderr)
        except ImportError:
            self._print()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        else:
            self._print()

    def _print(self) -> None:
        dt = time.perf_counter() - self.t0
        sys.stderr.write(f"\rconverting: {self.done}/{self.total} shards, {dt:.0f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")


def progress_callback(progress: Progress | None, prefix: str):
    from dask.callbacks import Callback

    class _CB(Callback):
        def _posttask(self, key, result, dsk, state, worker_id):
            if progress is not None and isinstance(key, str) and key.startswith(prefix):
                progress.update()

    return _CB()
