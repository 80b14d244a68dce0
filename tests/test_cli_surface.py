"""The surface a new user meets first (issue 28, row M): a misspelt option, an unknown or
missing dataset, an option that does not apply. Each is refused in one line on stderr, exit 2,
with no traceback, nothing written (no ``.dpmerge/``, no output directory), and before torch,
MLflow or Prefect is imported, so it arrives at once (README.md#the-command-line).

Speed is asserted by what was imported, not by the wall clock (CI runs the suite on three
workers on two cores); the measured times are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import fresh_env

from dpmerge.data import sources
from dpmerge.errors import DatasetError

HEAVY = ("torch", "opacus", "mlflow", "prefect", "dp_accounting", "scipy")
"""Seconds to import (the ML stack, the servers' clients, the accountants): none may load before a
refusal."""
PROBE = """
import contextlib, io, json, sys, time
from flows.cli import main
results = []
for args in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(args)
        except SystemExit as exit:
            code = exit.code
        except BaseException as error:  # a traceback's worth, recorded, not raised
            code = repr(error)
    results.append({"args": args, "code": code, "stderr": err.getvalue(),
                    "stdout": out.getvalue(), "seconds": time.perf_counter() - start,
                    "heavy": sorted(m for m in sys.argv[2:] if m in sys.modules)})
print(json.dumps(results))
"""
TRAIN = ["train", "--out", "out", "--model", "logreg", "--noise-multiplier", "1"]
MERGE = ["merge", "--inputs", "a", "--method", "lc", "--weights", "1", "--out", "out"]

REFUSALS: list[tuple[list[str], str]] = [
    # row M as reported
    (["demo", "--dataset", "mydata.csv"], "invalid choice: 'mydata.csv'"),
    (["demo", "--dataset", "digits", "--data-root", "mydata.csv"], "unknown option --data-root"),
    (["demo", "--datset", "digits"], "did you mean --dataset?"),
    # a dataset that is unknown, missing, or given a folder it does not read
    ([*TRAIN, "--dataset", "mydata.csv"], "invalid choice: 'mydata.csv'"),
    ([*TRAIN, "--dataset", "digits", "--data-root", "mydata.csv"], "reads no folder"),
    ([*TRAIN, "--dataset", "mnist"], "no folder given for mnist"),
    ([*TRAIN, "--dataset", "cifar10", "--data-root", "nowhere"], "not found: nowhere"),
    (["evaluate", "m", "--dataset", "digits", "--data-root", "mydata.csv"], "reads no folder"),
    (["evaluate", "m", "--dataset", "mnist", "--data-root", "nowhere"], "not found: nowhere"),
    ([*MERGE, "--data-root", "mydata.csv"], "--data-root applies only with --dataset"),
    ([*MERGE, "--limit", "5"], "--limit applies only with --dataset"),
    ([*MERGE, "--dataset", "digits", "--data-root", "d"], "reads no folder"),
    (["study", "frontier", "--quick", "--data-root", "mydata.csv"], "reads no folder"),
    (["study", "non-convex", "--dataset", "mydata.csv"], "unknown dataset 'mydata.csv'"),
    (["study", "pretrained", "--dataset", "mnist"], "no folder given for mnist"),
    (["study", "diamonds-table", "--out", "o", "--source", "d.csv"], "CSV not found: d.csv"),
    (["demo", "--dataset", "digits", "--noise-multipliers", "1,-2"], "must be positive"),
    (["demo", "--dataset", "digits", "--epochs", "0"], "expected a positive whole number"),
    (["demo", "--dataset", "digits", "--noise-multipliers", "1,x"], "comma-separated numbers"),
    # a negative number in exponent form is a value (refused as a δ), not a missing value
    (
        ["policy", "set", "--name", "eu", "--target-epsilon", "1", "--delta", "-1e-5"],
        "target_delta",
    ),
    # a misspelt option, at every level of every command
    (["--bogus"], "unknown option --bogus"),
    (["trian"], "unknown command 'trian'; did you mean 'train'?"),
    (["xyzzy", "--bogus"], "unknown command 'xyzzy' (commands: account, "),
    (["--bogus", "train"], "unknown option --bogus"),
    (["account", "--delat", "1e-5"], "did you mean --delta?"),
    (["study", "--bogus"], "study: unknown option --bogus"),
    (["study", "frontier", "--seedz", "2"], "did you mean --seeds?"),
    (["study", "mean-estimation", "--sigma", "1"], "did you mean --sigmas?"),
    (["study", "non-convex", "--bogus"], "unknown option --bogus"),
    (["study", "pretrained", "--bogus"], "unknown option --bogus"),
    (["train", "--epoch", "3"], "did you mean --epochs?"),
    ([*MERGE, "--audit-fil", "x"], "did you mean --audit-file?"),
    (["evaluate", "m", "--dataset", "digits", "--splt", "test"], "did you mean --split?"),
    (["candidates", "list", "d", "--bogus"], "unknown option --bogus"),
    (["candidates", "import", "w", "--atested-by", "x"], "did you mean --attested-by?"),
    (["registry", "--bogus"], "registry: unknown option --bogus"),
    (["registry", "ls", "--jsn"], "did you mean --json?"),
    (["registry", "show", "x", "--jsn"], "did you mean --json?"),
    (["registry", "quarantine", "--bogus"], "unknown option --bogus"),
    (["registry", "verify", "--repiar"], "did you mean --repair?"),
    (["ledger", "--bogus"], "ledger: unknown option --bogus"),
    (["ledger", "rebuild", "--bogus"], "unknown option --bogus"),
    (["state", "restore", "--bogus"], "unknown option --bogus"),
    (["verify", "x", "--jsn"], "did you mean --json?"),
    (["policy", "--bogus", "set"], "policy: unknown option --bogus"),
    (["policy", "set", "--name", "eu", "--target-epsilom", "1"], "did you mean --target-epsilon?"),
    (["policy", "apply", "-f", "p.yaml", "--dry-rn"], "did you mean --dry-run?"),
    (["policy", "ls", "--jsn"], "did you mean --json?"),
    (["policy", "show", "eu", "--jsn"], "did you mean --json?"),
    (["policy", "history", "eu", "--jsn"], "did you mean --json?"),
    (["stack", "--bogus"], "stack: unknown option --bogus"),
    (["stack", "up", "--no-prefct"], "did you mean --no-prefect?"),
    (["stack", "down", "--bogus"], "unknown option --bogus"),
    (["stack", "status", "--jsn"], "did you mean --json?"),
    (["stack", "env", "--rol", "operator"], "did you mean --role?"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Every refusal, run by the console script's ``main`` in one fresh process whose working
    directory is empty, its embedded home (``./.dpmerge``) and stack directory absent."""
    tmp = tmp_path_factory.mktemp("surface")
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in fresh_env(tmp).items() if k != "DPMERGE_HOME"}
    cases = json.dumps([args for args, _ in REFUSALS])
    done = subprocess.run(
        [sys.executable, "-c", PROBE, cases, *HEAVY],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return work, json.loads(done.stdout)


@pytest.mark.parametrize(("index", "said"), [(i, said) for i, (_, said) in enumerate(REFUSALS)])
def test_a_refusal_is_one_line_exit_2_before_anything_heavy(
    refusals: tuple[Path, list[dict]], index: int, said: str
) -> None:
    _, results = refusals
    result = results[index]
    lines = result["stderr"].splitlines()
    assert result["code"] == 2, result
    assert len(lines) == 1 and lines[0].startswith("dpmerge: error: "), result
    assert said in lines[0], result
    assert "Traceback" not in result["stderr"] and result["stdout"] == ""
    # modules only accumulate: the first case that loads one of them is the one named
    assert result["heavy"] == [], f"{result['args']} imported {result['heavy']}"


def test_a_refusal_leaves_nothing_behind(refusals: tuple[Path, list[dict]]) -> None:
    work, results = refusals
    assert len(results) == len(REFUSALS)
    assert list(work.iterdir()) == []  # no .dpmerge/, no output directory
    assert not (work.parent / "no-stack").exists() and not (work.parent / "home").exists()
    slowest = max(results, key=lambda r: r["seconds"])
    print(
        f"{len(results)} refusals, slowest {slowest['seconds']:.2f} s in-process: "
        f"{' '.join(slowest['args'])}"
    )


def test_row_m_from_the_shell(tmp_path: Path) -> None:
    """The three commands of the report, each in its own process as a shell runs them."""
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in fresh_env(tmp_path).items() if k != "DPMERGE_HOME"}
    for args in (
        ["demo", "--dataset", "mydata.csv"],
        [*TRAIN, "--dataset", "digits", "--data-root", "mydata.csv"],
        ["policy", "set", "--name", "eu", "--target-epsilom", "1"],
    ):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "flows.cli", *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        seconds = time.perf_counter() - start
        imported = {
            line.rsplit("|", 1)[1].strip()
            for line in done.stderr.splitlines()
            if line.startswith("import time:")
        }
        said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
        assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
        assert len(said) == 1 and said[0].startswith("dpmerge: error: "), said
        assert imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))
        assert list(work.iterdir()) == []
        print(f"{' '.join(args)}: {seconds:.2f} s with the interpreter")


def test_a_dataset_source_is_checked_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fashion-MNIST absent (its Debian package not installed) is named before anything runs;
    a folder given to digits is refused rather than ignored."""
    monkeypatch.setattr(sources, "FASHION_MNIST_ROOT", str(tmp_path / "absent"))
    monkeypatch.setitem(sources.DEFAULT_ROOTS, "fashion-mnist", str(tmp_path / "absent"))
    with pytest.raises(DatasetError, match=sources.FASHION_MNIST_PACKAGE):
        sources.check_source("fashion-mnist", None)
    assert sources.default_dataset() == "digits"
    with pytest.raises(DatasetError, match="reads no folder"):
        sources.check_source("digits", tmp_path)
    with pytest.raises(DatasetError, match="unknown dataset"):
        sources.check_source("mydata.csv", None)
    (tmp_path / "mnist").mkdir()
    sources.check_source("mnist", tmp_path / "mnist")  # present: the reader names its files
    sources.check_source("digits", None)


def test_commands_run_with_mlflow_quiet(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`dpmerge verify` printed MLflow's download progress bars before its result line: every
    command turns them off (an explicit setting is kept)."""
    from dpmerge.environment import QUIET
    from flows.cli import main

    for name in QUIET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")
    assert main(["verify", "@policy-eu", "--public-key", "00"]) == 2
    assert "not an Ed25519 public key" in capsys.readouterr().err
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "false"
