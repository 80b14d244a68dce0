"""Merge throughput and memory: LC of 5 ResNet-18-sized candidates vs a plain streamed copy.

Writes 5 synthetic candidates with the real ``resnet18_gn`` state-dict shapes (CIFAR-10 head,
~11.2M float32 parameters each) as safetensors files in a temporary directory, then measures in
one run:

* ``copy``: the same streaming (one file open at a time, one tensor at a time through
  ``safe_open``) copying every tensor into an output state dict — the I/O floor of a merge;
* ``merge``: ``dpmerge.merging.linear_combination`` with λ = 1/5 each (finiteness checks and
  float32 accumulation included).

Throughput is candidate bytes read per second (page cache warm); copy and merge runs are
interleaved so that load from other processes slows both alike. Peak RSS growth is VmHWM after
one run minus VmRSS before it (the peak is reset through /proc/self/clear_refs; Linux only),
compared with one model's size.

    .venv/bin/python benchmarks/bench_merge.py [--device cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dpmerge.artifacts import ModelSpec
from dpmerge.merging import linear_combination
from dpmerge.models import build_model

CANDIDATES = 5
SPEC = ModelSpec("resnet18_gn", (3, 32, 32), 10)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def streamed_copy(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
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
    files: list[Path], device: torch.device
) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    weights = [1 / len(files)] * len(files)
    return {
        "copy": lambda: streamed_copy(files, device),
        "merge": lambda: linear_combination(files, weights, device=device),
    }


def peak_rss_growth(run: Callable[[], dict[str, torch.Tensor]]) -> int:
    """VmHWM during one ``run`` minus VmRSS before it, in bytes (peak reset via clear_refs)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    result = run()
    growth = (_status_kib("VmHWM") - before) * 1024
    del result
    return growth


def peak_rss_growth_in_fresh_process(name: str, folder: str, device: torch.device) -> int:
    """Measured in a new interpreter: memory an earlier run freed to the allocator (but not to
    the OS) would otherwise hide part of the growth."""
    command = [sys.executable, __file__, "--device", str(device), "--rss-of", name, folder]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rss-of", choices=("copy", "merge"), help=argparse.SUPPRESS)
    parser.add_argument("folder", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.rss_of:  # child process of peak_rss_growth_in_fresh_process
        files = sorted(Path(args.folder).glob("*.safetensors"))
        print(peak_rss_growth(make_runs(files, device)[args.rss_of]))
        return
    shapes = {k: v.shape for k, v in build_model(SPEC).state_dict().items()}
    params = sum(torch.Size(s).numel() for s in shapes.values())
    model_bytes = 4 * params
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i in range(CANDIDATES):
            generator = torch.Generator().manual_seed(i)
            tensors = {k: torch.randn(s, generator=generator) for k, s in shapes.items()}
            files.append(Path(tmp) / f"candidate-{i}.safetensors")
            save_file(tensors, str(files[-1]))
            del tensors
        runs = make_runs(files, device)
        wall, cpu = timings(runs, args.repeats, device)
        growth = {name: peak_rss_growth_in_fresh_process(name, tmp, device) for name in runs}
    read = CANDIDATES * model_bytes
    print(
        f"{CANDIDATES} candidates × {params / 1e6:.2f}M float32 params "
        f"({model_bytes / 2**20:.1f} MiB each), device {device}, "
        f"torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats"
    )
    print(
        f"{'':<6} {'wall s':>7} {'GB/s':>6} {'CPU s':>6} {'GB/CPU-s':>9} "
        f"{'peak RSS growth':>16} {'÷ model':>8}   (medians)"
    )
    median = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in runs}
    for name, (seconds, cpu_seconds) in median.items():
        print(
            f"{name:<6} {seconds:>7.3f} {read / seconds / 1e9:>6.2f} {cpu_seconds:>6.3f} "
            f"{read / cpu_seconds / 1e9:>9.2f} {growth[name] / 2**20:>12.1f} MiB "
            f"{growth[name] / model_bytes:>8.2f}"
        )
    print(
        "merge throughput ÷ copy throughput (goal ≥ 0.5): "
        f"{median['copy'][0] / median['merge'][0]:.2f} wall, "
        f"{median['copy'][1] / median['merge'][1]:.2f} CPU; "
        f"best wall {min(wall['copy']) / min(wall['merge']):.2f}"
    )


if __name__ == "__main__":
    main()
