"""Every performance figure of dpmerge as ratios measured in one run (not timed tests).

    .venv/bin/python benchmarks/run_all.py [--repeats 3] [--skip time-to-policy] [--json F]

Prints one Markdown table: for each figure the median of ``--repeats`` repetitions, the
quantity it is compared with in the same run, their ratio, the goal, and the machine's load
average over the measurement (a busy 2-core machine moves absolute times, so compare ratios):

* calibration latency per target for RS, LC under the generic gate and LC under the structured
  gate (5 candidates, ``bench_calibration.py``'s ladder), against the goals 0.1 s / 1 s / 1 s;
* accounting tightness: each candidate's certified PLD ε ÷ Opacus' PRV estimate, with PRV's
  certified bounds (≈ 1 and inside the bounds: dpmerge's pessimistic ε gives nothing away);
* DP-SGD throughput ÷ non-private throughput per model in its default grad-sample mode
  (``bench_training.py``, 1 thread, the two alternating in each repetition);
* LC merge throughput ÷ streamed tensor copy, and peak RSS growth ÷ one model's size
  (``bench_merge.py``, 2, 5 and 20 candidates of a 564 MB model);
* time-to-policy (policy change requested → alias moved on the local stack) ÷ retraining the
  same model at the target (``bench_time_to_policy.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_calibration  # noqa: E402
import bench_merge  # noqa: E402
import bench_training  # noqa: E402

SECTIONS = ("calibration", "tightness", "training", "merge", "time-to-policy")


@dataclass(frozen=True)
class Row:
    figure: str
    measured: float
    reference: str
    ratio: float | None
    goal: str
    load: tuple[float, float]


def _load_during(run: Callable[[], object]) -> tuple[object, tuple[float, float]]:
    before = os.getloadavg()[0]
    value = run()
    return value, (before, os.getloadavg()[0])


def calibration(repeats: int) -> list[Row]:
    from dpmerge.accounting.calibration import calibrate
    from dpmerge.accounting.candidate import candidate_bound

    records = bench_calibration.candidates()
    eps = [candidate_bound(c, bench_calibration.DELTA).epsilon for c in records]
    targets = [min(eps) * 1.02 * (max(eps) * 0.98 / (min(eps) * 1.02)) ** (i / 8) for i in range(9)]
    rows = []
    for label, method, bound, goal in (
        ("RS", "rs", "generic", 0.1),
        ("LC, generic gate", "lc", "generic", 1.0),
        ("LC, structured gate", "lc", "structured", 1.0),
    ):

        def measure(method=method, bound=bound) -> list[float]:
            times = []
            for _ in range(repeats):
                for target in targets:
                    start = time.perf_counter()
                    result = calibrate(
                        records, method, target, bench_calibration.DELTA, gating_bound=bound
                    )
                    times.append(time.perf_counter() - start)
                    assert result.epsilon <= target
            return times

        times, load = _load_during(measure)
        median = statistics.median(times)  # type: ignore[arg-type]
        rows.append(
            Row(
                f"calibration latency, {label} (s per target, 5 candidates, 9 targets)",
                median,
                f"goal {goal:g} s",
                median / goal,
                "ratio ≤ 1",
                load,
            )
        )
    return rows


def tightness() -> list[Row]:
    from opacus.accountants import PRVAccountant

    from dpmerge.accounting.candidate import candidate_bound

    rows = []
    for record in bench_calibration.candidates():

        def measure(record=record) -> tuple[float, tuple[float, float, float]]:
            ours = candidate_bound(record, bench_calibration.DELTA).epsilon_pld
            prv = PRVAccountant()
            prv.history = [(record.noise_multiplier, record.sample_rate, record.steps)]
            delta = bench_calibration.DELTA
            dprv = prv._get_dprv(eps_error=0.01, delta_error=delta / 1000)
            return ours, dprv.compute_epsilon(delta, delta / 1000, 0.01)

        (ours, (low, estimate, high)), load = _load_during(measure)
        rows.append(
            Row(
                f"candidate ε, PLD (σ = {record.noise_multiplier:g}, T = {record.steps})",
                ours,
                f"Opacus PRV estimate {estimate:.4f} in [{low:.4f}, {high:.4f}]",
                ours / estimate,
                "≈ 1, inside PRV's bounds",
                load,
            )
        )
    return rows


def training(repeats: int) -> list[Row]:
    import torch

    from dpmerge.data import Split, load_dataset
    from dpmerge.training import DEFAULT_GRAD_SAMPLE_MODE

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    data = load_dataset("fashion-mnist")
    empty = Split(data.test.features[:0], data.test.labels[:0])
    data = replace(data, validation=empty, test=empty)
    rows = []
    for model, goal in (("logreg", "≥ 0.5"), ("cnn", "≥ 0.7")):
        mode, steps = DEFAULT_GRAD_SAMPLE_MODE[model], bench_training.STEPS[model]

        def measure(model=model, mode=mode, steps=steps) -> tuple[list[float], list[float]]:
            private, plain = [], []
            for _ in range(repeats):
                plain.append(bench_training.non_private(data, model, steps))
                private.append(bench_training.private(data, model, mode, steps))
            return private, plain

        (private, plain), load = _load_during(measure)
        dp, base = statistics.median(private), statistics.median(plain)
        rows.append(
            Row(
                f"DP-SGD throughput, {model} ({mode}, 1 thread, examples/s)",
                dp,
                f"non-private {base:,.0f}/s",
                dp / base,
                goal,
                load,
            )
        )
    return rows


def merge(repeats: int) -> list[Row]:
    import torch

    results, skipped = bench_merge.measure_all(bench_merge.COUNTS, repeats, torch.device("cpu"))
    if skipped:
        print(f"merge: skipped for want of disk: {skipped} candidates", file=sys.stderr)
    size = f"{bench_merge.MODEL_BYTES / 1e6:.0f} MB"
    rows = []
    for m in results:
        rows.append(
            Row(
                f"LC merge throughput, {m.candidates} candidates of {size} (GB/s)",
                m.read_bytes() / m.wall["merge"] / 1e9,
                f"streamed copy {m.read_bytes() / m.wall['copy'] / 1e9:.2f} GB/s",
                m.wall["copy"] / m.wall["merge"],
                "≥ 0.5",
                m.load,
            )
        )
        rows.append(
            Row(
                f"LC merge peak RSS growth, {m.candidates} candidates (MiB)",
                m.growth["merge"] / 2**20,
                f"one model {bench_merge.MODEL_BYTES / 2**20:.0f} MiB",
                m.growth["merge"] / bench_merge.MODEL_BYTES,
                "≤ 1.5",
                m.load,
            )
        )
    return rows


def time_to_policy() -> list[Row]:
    """Runs ``bench_time_to_policy.py --phases idle --json`` (it starts and stops its own local
    stack)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        before = os.getloadavg()[0]
        subprocess.run(
            [
                *(sys.executable, str(HERE / "bench_time_to_policy.py")),
                *("--phases", "idle", "--json", out.name),
            ],
            check=True,
            stdout=sys.stderr,
        )
        result = json.loads(Path(out.name).read_text())
        load = (before, os.getloadavg()[0])
    idle = result["phases"]["idle"]
    policy = idle["p50_s"]
    return [
        Row(
            f"time-to-policy, change requested → alias moved (s, median of {idle['changes']})",
            policy,
            f"retraining at the target: {retrain:.1f} s {where}",
            policy / retrain,
            "requested → alias p95 ≤ 10 s idle",
            load,
        )
        for where, retrain in (
            ("in-process", result["retrain_in_process_s"]),
            ("through the training deployment", result["retrain_on_stack_s"]),
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", choices=SECTIONS, default=[])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    rows: list[Row] = []
    for section, run in (
        ("calibration", lambda: calibration(args.repeats)),
        ("tightness", tightness),
        ("training", lambda: training(args.repeats)),
        ("merge", lambda: merge(args.repeats)),
        ("time-to-policy", time_to_policy),
    ):
        if section not in args.skip:
            print(f"… {section}", file=sys.stderr, flush=True)
            rows.extend(run())
    print(
        f"dpmerge benchmarks, {started}, {os.cpu_count()} CPUs, medians of {args.repeats} "
        "repetitions; load = 1-minute load average before → after each figure\n"
    )
    print("| figure | measured | compared with | ratio | goal | load |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ratio = "—" if row.ratio is None else f"{row.ratio:.4g}"
        print(
            f"| {row.figure} | {row.measured:.4g} | {row.reference} | {ratio} | {row.goal} "
            f"| {row.load[0]:.1f} → {row.load[1]:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=2))


if __name__ == "__main__":
    main()
