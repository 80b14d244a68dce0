"""A burst of policy changes: N ``dpmerge.policy.updated`` events over P policies, sent as fast
as the client can, drained by ``merge-on-policy`` on the local stack.

Run: ``.venv/bin/python benchmarks/bench_policy_burst.py [--events 50] [--policies 3]``
(``--reuse-stack`` drives the stack this shell points at, with its deployments and candidates).

It starts a stack on free ports, deploys ``merge-on-policy``, trains and registers five
Fashion-MNIST logistic-regression candidates here, then sends the events (targets drawn from
``--targets``, policies in turn) and waits until every event's run is final. It prints: events
sent, runs created, events lost (no run), the final states, the drain time (first event sent →
last run finished), whether two runs of one policy ever overlapped, whether runs of different
policies did (side by side), and whether each policy's alias ends on its latest event's target.
Figures are recorded in docs/workflow.md#throughput; the goal on the 2-core development machine
is 0 lost and ≤ 3 min for 50 events over 3 policies.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
import warnings
from datetime import UTC, datetime
from typing import Any

from harness import deploy, local_stack, policy_runs, train_candidates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50)
    parser.add_argument("--policies", type=int, default=3)
    parser.add_argument("--targets", default="0.5,0.75,1,1.5,2,3", help="ε* drawn per event")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--sigmas", default="0.7,0.9,1.2,1.8,3.0")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--state-dir", default=None, help="stack state, kept (default: temporary)")
    parser.add_argument("--reuse-stack", action="store_true", help="the stack of $PREFECT_API_URL")
    parser.add_argument("--seed", type=int, default=0, help="order of the targets")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    with local_stack(args.state_dir, args.reuse_stack) as url:
        if not args.reuse_stack:
            deploy("merge-on-policy/merge-on-policy")
            sigmas = [float(s) for s in args.sigmas.split(",")]
            train_candidates(args.dataset, sigmas, args.epochs, 1e-5)
        return burst(args, url)


def burst(args: argparse.Namespace, url: str) -> int:
    from mlflow import MlflowClient

    from dpmerge import policy_merge as pm
    from dpmerge.policies import policy_from_dict
    from flows import runtime

    rng = random.Random(args.seed)
    targets = [float(t) for t in args.targets.split(",")]
    names = [f"burst-{chr(ord('a') + i)}" for i in range(args.policies)]
    since = datetime.now(UTC)
    sent: list[tuple[str, str, float]] = []  # event id, policy, target
    start = time.monotonic()
    for i in range(args.events):
        policy = policy_from_dict(
            {
                "name": names[i % len(names)],
                "target_epsilon": rng.choice(targets),
                "target_delta": 1e-5,
                "dataset": args.dataset,
                "model": "logreg",
            }
        )
        event = runtime.emit_policy_event(policy.event_payload(), policy.resource_id, policy.name)
        sent.append((event, policy.name, policy.target_epsilon))
    emitted = time.monotonic() - start
    print(f"sent {len(sent)} events over {len(names)} policies in {emitted:.1f} s")
    by_event: dict[str, Any] = {}
    while time.monotonic() - start < args.timeout:
        runs = policy_runs(url, since)
        by_event = {str(r.parameters.get("event_id")): r for r in runs}
        final = [r for r in by_event.values() if r.state and r.state.is_final()]
        if len(final) >= len(sent) and all(e in by_event for e, _, _ in sent):
            break
        time.sleep(1.0)
    runs = [by_event[e] for e, _, _ in sent if e in by_event]
    ends = [r.end_time for r in runs if r.end_time is not None]
    drain = (max(ends) - since).total_seconds() if ends else float("nan")
    states = collections.Counter(r.state.name if r.state else "none" for r in runs)
    print(f"runs created {len(runs)}, lost {len(sent) - len(runs)}")
    print(f"final states: {dict(states)}")
    print(f"drain (first event sent → last run finished): {drain:.1f} s")
    overlap_same, overlap_other = _overlaps(url, runs)
    print(f"runs of one policy overlapping: {overlap_same}; of different policies: {overlap_other}")
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    merged = pm.find_candidates(pm.Workspace.from_env().registry(), args.dataset, "logreg")
    correct = 0
    for name in names:
        latest = [t for _, n, t in sent if n == name][-1]
        alias = f"policy-{name}"
        model = client.get_registered_model(merged.merged_model)
        version = model.aliases.get(alias)
        served = (
            float(client.get_model_version(merged.merged_model, version).tags["dp.target_epsilon"])
            if version
            else None
        )
        correct += served == latest
        print(f"  {alias}: latest event ε* = {latest:g}, alias → v{version} (ε* = {served})")
    lost = len(sent) - len(runs)
    unfinished = sum(1 for r in runs if not (r.state and r.state.is_final()))
    failed = sum(1 for r in runs if r.state and (r.state.is_failed() or r.state.is_crashed()))
    ok = not (lost or unfinished or failed or overlap_same) and correct == len(names)
    print(
        f"summary: {len(sent)} sent, {lost} lost, {failed} failed or crashed, "
        f"drain {drain:.0f} s, " + ("ok" if ok else "NOT OK")
    )
    return 0 if ok else 1


def _overlaps(url: str, runs: list[Any]) -> tuple[int, int]:
    """Pairs of runs whose work (their task runs: taken under the policy's lock) overlapped in
    time: of the same policy, and of different policies."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with SyncPrefectClient(url, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])),
        )
    spans: dict[Any, list[Any]] = {}
    for task in tasks:
        if task.start_time and task.end_time:
            span = spans.setdefault(task.flow_run_id, [task.start_time, task.end_time])
            span[0], span[1] = min(span[0], task.start_time), max(span[1], task.end_time)
    policy = {r.id: r.parameters["payload"]["name"] for r in runs}
    worked = list(spans.items())
    same = other = 0
    for i, (a, (a0, a1)) in enumerate(worked):
        for b, (b0, b1) in worked[i + 1 :]:
            if a0 < b1 and b0 < a1:
                same += policy[a] == policy[b]
                other += policy[a] != policy[b]
    return same, other


if __name__ == "__main__":
    sys.exit(main())
