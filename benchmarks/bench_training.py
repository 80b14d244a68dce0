"""DP-SGD throughput against non-private SGD, per model and grad_sample_mode (engine).

Run: ``.venv/bin/python benchmarks/bench_training.py [--threads 1 2] [--repeats 3]
[--device cuda] [--models logreg cnn resnet18_gn] [--modes vmap layers]
[--dataset fashion-mnist|cifar10-synthetic]``

Both sides train the same architecture on Fashion-MNIST rows with B = 256 and plain SGD; the
DP side is ``dpmerge.training.train_candidate`` (Poisson sampling, clipping, noise, accounting),
timed over its step loop only, in every mode valid for the model: the Opacus modes and, for
logreg, the linear-exact engine. Variants are interleaved and repeated, and each ratio
uses medians from the same run, because a shared 2-core machine is noisy. Results and the
chosen defaults are recorded in docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from dataclasses import replace

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dpmerge.data import DatasetSplits, Split, collate_batch, load_dataset
from dpmerge.data.splits import make_splits
from dpmerge.models import build_model, model_spec
from dpmerge.training import (
    GRAD_SAMPLE_MODES,
    LINEAR_EXACT,
    LINEAR_EXACT_MODELS,
    TrainConfig,
    train_candidate,
)

BATCH = 256
STEPS = {"logreg": 200, "cnn": 30, "resnet18_gn": 20}
WARMUP_STEPS = 3


def non_private(data: DatasetSplits, model_name: str, steps: int, device: str = "cpu") -> float:
    """Examples per second of plain SGD on shuffled fixed-size batches (loading included)."""
    model = build_model(model_spec(model_name, data), seed=0).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(
        data.train.as_dataset(),
        batch_size=BATCH,
        shuffle=True,
        collate_fn=collate_batch,
        generator=torch.Generator().manual_seed(0),
    )
    batches = iter(loader)
    criterion = nn.CrossEntropyLoss()
    examples, start = 0, 0.0
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            examples, start = 0, time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()
        examples += len(y)
    if device != "cpu":
        torch.cuda.synchronize()
    return examples / (time.perf_counter() - start)


def private(
    data: DatasetSplits, model_name: str, mode: str, steps: int, device: str = "cpu"
) -> float:
    """Examples per second (expected batch × steps / loop time) of a DP-SGD run."""
    config = TrainConfig(
        dataset=data.name,
        model=model_name,
        noise_multiplier=1.0,
        batch_size=BATCH,
        noise_seed=0,
        batch_seed=0,
        grad_sample_mode=mode,
        max_steps=steps,
        device=device,
    )
    train_candidate(replace(config, max_steps=WARMUP_STEPS), data)
    result = train_candidate(config, data)
    return result.record.steps * result.record.expected_batch_size / result.metrics["train_seconds"]


def cifar_shaped(n: int = 50_000) -> DatasetSplits:
    """Random CIFAR-10-shaped rows: throughput does not depend on pixel values."""
    rng = np.random.default_rng(0)
    return make_splits(
        "cifar10",
        train_images=rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
        train_labels=rng.integers(0, 10, n),
        test_images=np.zeros((0, 3, 32, 32), np.uint8),
        test_labels=np.zeros(0, np.int64),
        num_classes=10,
        scale=255.0,
        seed=0,
        validation_fraction=0.0,
        root=None,
    )


def variants(model_name: str, chosen: list[str]) -> list[str]:
    """non-private, then every grad_sample_mode in ``chosen`` that can run ``model_name``."""
    modes = [m for m in chosen if m != LINEAR_EXACT or model_name in LINEAR_EXACT_MODELS]
    return ["non-private", *modes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["logreg", "cnn"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--modes", nargs="+", choices=GRAD_SAMPLE_MODES, default=GRAD_SAMPLE_MODES)
    parser.add_argument(
        "--dataset",
        default="fashion-mnist",
        choices=("fashion-mnist", "cifar10-shaped"),
        help="cifar10-shaped: 50 000 random 3×32×32 images (throughput only; for resnet18_gn)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)

    data = load_dataset("fashion-mnist") if args.dataset == "fashion-mnist" else cifar_shaped()
    empty = Split(data.test.features[:0], data.test.labels[:0])
    data = replace(data, validation=empty, test=empty)  # skip evaluation: time training only
    samples: dict[tuple[int, str, str], list[float]] = {}
    load_before = os.getloadavg()[0]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            for model_name in args.models:
                for variant in variants(model_name, args.modes):
                    steps = STEPS[model_name]
                    rate = (
                        non_private(data, model_name, steps, args.device)
                        if variant == "non-private"
                        else private(data, model_name, variant, steps, args.device)
                    )
                    samples.setdefault((threads, model_name, variant), []).append(rate)

    print(f"{data.name}, B = {BATCH}, n = {data.dataset_size}, medians of {args.repeats}")
    device = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, device {device}")
    print(f"load average {load_before:.1f} → {os.getloadavg()[0]:.1f}")
    print()
    print("| threads | model | variant | examples/s | ratio to non-private |")
    print("|---|---|---|---|---|")
    for threads in args.threads:
        for model_name in args.models:
            base = statistics.median(samples[(threads, model_name, "non-private")])
            for variant in variants(model_name, args.modes):
                rate = statistics.median(samples[(threads, model_name, variant)])
                print(f"| {threads} | {model_name} | {variant} | {rate:,.0f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
