"""Merge time and memory: LC of 2, 5 and 20 candidates of a 564 MB model vs a streamed copy.

Writes 20 synthetic candidates with the state-dict shapes of a small decoder-only transformer
(``SHAPES``: 32 000-token vocabulary, width 1024, 6 blocks, untied head; 141M float32
parameters, 538 MiB each) as safetensors files in a temporary directory (it needs 20 models'
size plus 5 GiB free, or the counts that fit are measured and the rest named as skipped; the
files are deleted afterwards), then measures for each number of candidates n:

* ``copy``: a plain streamed copy — each of the n files opened once with ``safe_open`` and
  every tensor copied into an output state dict: the I/O floor of a merge;
* ``merge``: ``dpmerge.merging.linear_combination`` with λ = 1/n each (finiteness checks and
  float32 accumulation included).

Times are medians of ``--repeats`` runs, copy and merge interleaved so that load from other
processes slows both alike, page cache warm. Peak RSS growth is measured in a fresh
interpreter per run (VmHWM after the run minus VmRSS before it; the peak is reset through
/proc/self/clear_refs; Linux only), so memory one run freed to the allocator cannot hide
another's, and is compared with one model's size. The 1-minute load average
(``os.getloadavg``, /proc/loadavg) is printed before → after each n.

    .venv/bin/python benchmarks/bench_merge.py [--candidates 2 5 20] [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dpmerge.merging import linear_combination

COUNTS = (2, 5, 20)
FREE_MARGIN = 5 * 2**30
"""Disk space left free after the candidates are written."""


def _transformer_shapes(vocab: int, width: int, blocks: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, width)}
    for b in range(blocks):
        for name in ("q", "k", "v", "o"):
            shapes[f"block{b}.attention.{name}.weight"] = (width, width)
        shapes[f"block{b}.mlp.up.weight"] = (4 * width, width)
        shapes[f"block{b}.mlp.down.weight"] = (width, 4 * width)
        shapes[f"block{b}.norm1.weight"] = shapes[f"block{b}.norm2.weight"] = (width,)
    shapes["norm.weight"] = (width,)
    shapes["head.weight"] = (vocab, width)
    return shapes


SHAPES = _transformer_shapes(32_000, 1024, 6)
MODEL_BYTES = 4 * sum(math.prod(s) for s in SHAPES.values())


@dataclass(frozen=True)
class Measurement:
    """One number of candidates: median wall and CPU seconds and peak RSS growth (bytes) of
    each run (``copy``, ``merge``), and the load average before and after."""

    candidates: int
    wall: dict[str, float]
    cpu: dict[str, float]
    growth: dict[str, int]
    load: tuple[float, float]

    def read_bytes(self) -> int:
        return self.candidates * MODEL_BYTES


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def streamed_copy(files: Sequence[Path], device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                tensor = handle.get_tensor(key)
                if key in out:
                    out[key].copy_(tensor)
                else:
                    out[key] = tensor.to(device, copy=True)
    return out


def make_runs(
    files: Sequence[Path], device: torch.device
) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    weights = [1 / len(files)] * len(files)
    return {
        "copy": lambda: streamed_copy(files, device),
        "merge": lambda: linear_combination(files, weights, device=device),
    }


def write_candidates(folder: Path, count: int) -> list[Path]:
    files = []
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {k: torch.randn(s, generator=generator) for k, s in SHAPES.items()}
        files.append(folder / f"candidate-{i:02d}.safetensors")
        save_file(tensors, str(files[-1]))
        del tensors
    return files


def counts_that_fit(folder: Path, counts: Sequence[int]) -> list[int]:
    """The counts whose candidates fit on ``folder``'s disk with ``FREE_MARGIN`` left free."""
    room = (shutil.disk_usage(folder).free - FREE_MARGIN) // MODEL_BYTES
    return [c for c in counts if c <= room]


def peak_rss_growth(run: Callable[[], dict[str, torch.Tensor]]) -> int:
    """VmHWM during one ``run`` minus VmRSS before it, in bytes (peak reset via clear_refs)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    result = run()
    growth = (_status_kib("VmHWM") - before) * 1024
    del result
    return growth


def peak_rss_growth_in_fresh_process(name: str, files: Sequence[Path], device: torch.device) -> int:
    """Measured in a new interpreter: memory an earlier run freed to the allocator (but not to
    the OS) would otherwise hide part of the growth."""
    command = [sys.executable, __file__, "--device", str(device), "--rss-of", name]
    command += [str(f) for f in files]
    return int(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def timings(
    runs: dict[str, Callable[[], dict[str, torch.Tensor]]], repeats: int, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU (this process, all threads) seconds of each run, interleaved so that a busy
    machine slows all of them alike."""
    for run in runs.values():
        run()  # warm-up: page cache, allocator, CUDA context
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def measure(files: Sequence[Path], count: int, repeats: int, device: torch.device) -> Measurement:
    """Time and peak RSS of the copy and the merge of the first ``count`` files."""
    chosen = files[:count]
    before = os.getloadavg()[0]
    runs = make_runs(chosen, device)
    wall, cpu = timings(runs, repeats, device)
    growth = {name: peak_rss_growth_in_fresh_process(name, chosen, device) for name in runs}
    return Measurement(
        count,
        {name: statistics.median(values) for name, values in wall.items()},
        {name: statistics.median(values) for name, values in cpu.items()},
        growth,
        (before, os.getloadavg()[0]),
    )


def measure_all(
    counts: Sequence[int], repeats: int, device: torch.device
) -> tuple[list[Measurement], list[int]]:
    """Write the candidates to a temporary directory, measure each count that fits and delete
    them; returns the measurements and the counts skipped for want of disk."""
    with tempfile.TemporaryDirectory(prefix="dpmerge-bench-merge-") as tmp:
        fit = counts_that_fit(Path(tmp), counts)
        skipped = [c for c in counts if c not in fit]
        files = write_candidates(Path(tmp), max(fit, default=0))
        return [measure(files, c, repeats, device) for c in fit], skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--candidates", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--rss-of", choices=("copy", "merge"), help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.rss_of:  # child process of peak_rss_growth_in_fresh_process
        print(peak_rss_growth(make_runs(args.files, device)[args.rss_of]))
        return
    results, skipped = measure_all(args.candidates, args.repeats, device)
    params = MODEL_BYTES // 4
    print(
        f"candidates of {params / 1e6:.1f}M float32 params ({MODEL_BYTES / 1e6:.0f} MB, "
        f"{MODEL_BYTES / 2**20:.0f} MiB each), device {device}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, medians of {args.repeats} interleaved repeats"
    )
    if skipped:
        print(f"skipped for want of disk (5 GiB kept free): {skipped} candidates")
    print(
        f"{'n':>3} {'run':<6} {'wall s':>7} {'GB/s':>6} {'CPU s':>6} "
        f"{'peak RSS growth':>16} {'÷ model':>8} {'merge ÷ copy time':>18} {'load':>11}"
    )
    for m in results:
        for name in ("copy", "merge"):
            ratio = f"{m.wall['merge'] / m.wall['copy']:.2f}" if name == "merge" else ""
            print(
                f"{m.candidates:>3} {name:<6} {m.wall[name]:>7.2f} "
                f"{m.read_bytes() / m.wall[name] / 1e9:>6.2f} {m.cpu[name]:>6.2f} "
                f"{m.growth[name] / 2**20:>12.0f} MiB {m.growth[name] / MODEL_BYTES:>8.2f} "
                f"{ratio:>18} {m.load[0]:>5.1f}→{m.load[1]:<5.1f}"
            )


if __name__ == "__main__":
    main()
