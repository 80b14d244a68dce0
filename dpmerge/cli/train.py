"""``dpmerge train``: train one DP-SGD candidate and write its model directory (SPEC §2).

Every check runs before training, so bad input writes nothing. The output directory holds
``weights.safetensors``, ``model.json``, ``record.json`` (the mechanism record and its ε under
PLD and RDP at ``--delta``) and ``metrics.json``. A one-line JSON summary goes to stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dpmerge.accounting.candidate import candidate_bound
from dpmerge.data import DATASET_NAMES, load_dataset
from dpmerge.training import (
    GRAD_SAMPLE_MODES,
    TrainConfig,
    TrainingConfigError,
    save_candidate,
    train_candidate,
)

DEFAULT_THREADS = 1
"""One intra-op thread: on a shared 2-core CPU two can be 10× slower (docs/training.md)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train one DP-SGD candidate (Poisson sampling, plain SGD)",
        description=__doc__,
    )
    parser.add_argument("--dataset", required=True, help=f"one of {', '.join(DATASET_NAMES)}")
    parser.add_argument("--model", required=True, help="logreg, cnn or resnet18_gn")
    parser.add_argument("--out", required=True, type=Path, help="new model directory")
    parser.add_argument("--noise-multiplier", type=float, help="σ (or give --target-epsilon)")
    parser.add_argument("--target-epsilon", type=float, help="calibrate σ to this PLD ε")
    parser.add_argument("--delta", type=float, default=1e-5, help="δ of the reported ε")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size")
    parser.add_argument("--lr", type=float, help="learning rate (default: per model)")
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--noise-seed", type=int, help="fixed noise seed (default: secret)")
    parser.add_argument(
        "--batch-seed", type=int, help="shared Poisson batch stream (default: independent)"
    )
    parser.add_argument("--init-checkpoint", help="public safetensors weights to start from")
    parser.add_argument("--data-root", help="folder holding the dataset files")
    parser.add_argument("--limit", type=int, help="use only the first rows of each file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--grad-sample-mode", help=f"one of {', '.join(GRAD_SAMPLE_MODES)}")
    parser.add_argument("--checkpoint", help="resumable training checkpoint file")
    parser.add_argument("--checkpoint-every", type=int, default=500, help="steps")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps")
    parser.add_argument("--name", help="candidate name in the record")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=handler)


def handler(args: argparse.Namespace) -> int:
    config = TrainConfig(
        dataset=args.dataset,
        model=args.model,
        noise_multiplier=args.noise_multiplier,
        target_epsilon=args.target_epsilon,
        delta=args.delta,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        clip_norm=args.clip_norm,
        init_seed=args.seed,
        noise_seed=args.noise_seed,
        batch_seed=args.batch_seed,
        init_checkpoint=args.init_checkpoint,
        device=args.device,
        grad_sample_mode=args.grad_sample_mode,
        checkpoint_path=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        max_steps=args.max_steps,
        progress=not args.no_progress,
        name=args.name,
    )
    if args.out.exists():
        raise TrainingConfigError(f"output directory already exists: {args.out}")
    if args.threads < 1:
        raise TrainingConfigError(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    data = load_dataset(args.dataset, args.data_root, limit=args.limit)
    result = train_candidate(config, data)
    out = save_candidate(result, args.out, args.delta)
    privacy = candidate_bound(result.record, args.delta)
    summary = {
        "out": str(out),
        "name": result.record.name,
        "noise_multiplier": result.record.noise_multiplier,
        "sample_rate": result.record.sample_rate,
        "steps": result.record.steps,
        "delta": args.delta,
        "epsilon_pld": privacy.epsilon_pld,
        "epsilon_rdp": privacy.epsilon_rdp,
        "validation_accuracy": result.metrics["validation_accuracy"],
        "test_accuracy": result.metrics["test_accuracy"],
    }
    print(json.dumps(summary))
    return 0
