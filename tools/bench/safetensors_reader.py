"""Reader benchmark: our ``weights.safetensors`` reader against the ``safetensors`` package's.

Writes one weights file (``--tensors`` f32 tensors, ``--mb`` MB in all) with
``runtime.weights.write_weights`` and times, interleaved in rounds with the page cache warm:

* ``ours index``: ``read_weights_index`` (the header alone: what the worker reads to size a
  model before loading it);
* ``ours arrays``: index + ``host_arrays()`` (zero-copy views over one memory map) + a sum of
  every tensor, so each byte is read once;
* ``safetensors load_file``: ``safetensors.numpy.load_file`` (copies every tensor into a fresh
  array) + the same sum;
* ``safetensors safe_open``: ``safe_open(framework="np")`` + ``get_tensor`` of each + the sum.

The package has no bfloat16 (nor fp8) for numpy, which bundles carry; it is timed on f32 only.

Usage: ``python tools/bench/safetensors_reader.py [--mb 256] [--tensors 64] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kserve_trio.runtime.weights import read_weights_index, write_weights


def _ours_index(path: Path) -> float:
    return float(len(read_weights_index(path).entries))


def _ours_arrays(path: Path) -> float:
    return float(sum(a.sum(dtype=np.float64) for a in read_weights_index(path).host_arrays()))


def _st_load_file(path: Path) -> float:
    from safetensors.numpy import load_file

    return float(sum(a.sum(dtype=np.float64) for a in load_file(str(path)).values()))


def _st_safe_open(path: Path) -> float:
    from safetensors import safe_open

    total = 0.0
    with safe_open(str(path), framework="np") as f:
        for key in f.keys():
            total += float(f.get_tensor(key).sum(dtype=np.float64))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    per = args.mb * (1 << 20) // 4 // args.tensors
    rng = np.random.default_rng(0)
    weights = [(f"w{i}", rng.standard_normal(per, dtype=np.float32)) for i in range(args.tensors)]
    cases: dict[str, Callable[[Path], float]] = {
        "ours index": _ours_index,
        "ours arrays": _ours_arrays,
        "safetensors load_file": _st_load_file,
        "safetensors safe_open": _st_safe_open,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        write_weights(path, weights)
        sums = {name: fn(path) for name, fn in cases.items()}  # warm the page cache
        reads = [sums[n] for n in cases if n != "ours index"]
        assert all(math.isclose(r, reads[0], rel_tol=1e-9) for r in reads), sums
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn(path)
                times[name].append(time.perf_counter() - t0)
    print(f"{args.tensors} f32 tensors, {args.mb} MB, median of {args.rounds} rounds (ms)")
    for name, ts in times.items():
        print(f"  {name:24s} {statistics.median(ts) * 1e3:9.2f}   (min {min(ts) * 1e3:.2f})")


if __name__ == "__main__":
    main()
