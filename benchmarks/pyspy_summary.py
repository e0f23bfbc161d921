"""Summarise a `py-spy record --threads -f raw` profile of benchmarks/read_loop.py: the share of
samples, over all threads, in which each function is on the stack, counting only samples taken
while a read or open was running (idle pool threads and imports left out).

    python benchmarks/pyspy_summary.py seg.raw [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import re

KEEP = ("_WorkItem.run", "open_dataset", "DataArray.values")
SKIP = ("thread", "Thread.", "_worker", "<module>", "main")


def summarise(path: str, top: int) -> str:
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            names = [re.sub(r" \(.*?\)", "", frame) for frame in stack.split(";")]
            if not any(k in names for k in KEEP):
                continue
            n = int(count)
            total += n
            for name in set(names):
                inclusive[name] += n
    lines = [f"samples in open + read (all threads): {total}"]
    for name, n in inclusive.most_common():
        if name.startswith(SKIP):
            continue
        lines.append(f"{100 * n / total:5.1f}%  {name}")
        if len(lines) > top:
            break
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    print(summarise(args.raw, args.top))


if __name__ == "__main__":
    main()
