"""The ``dpmerge account`` and ``dpmerge study`` commands: a stable scripting interface."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from factories import make_record

from dpmerge.accounting.records import PrivacyLabel, candidates_to_document
from dpmerge.cli import main


def record_dict(**overrides):
    data = make_record("a", 1.0).model_dump(mode="json", exclude_none=True)
    data.update(overrides)
    return data


@pytest.fixture
def candidates_file(tmp_path, short_ladder):
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps(candidates_to_document(short_ladder)))
    return path


def run(capsys, *argv):
    """Run the CLI in-process: any exception other than the parser's exit fails the test."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_inputs_the_audit_found_exit_with_one_line(capsys, tmp_path, candidates_file):
    """Every input of the audit: non-zero exit, one line on stderr, no traceback."""
    label = PrivacyLabel(name="vendor", dataset="fashion-mnist:test", epsilon=1.0, delta=1e-3)
    with_label = tmp_path / "label.json"
    with_label.write_text(json.dumps(candidates_to_document([make_record("a", 1.0), label])))
    tiny = record_dict(noise_multiplier=1e-300)
    tiny_file = tmp_path / "tiny.json"
    tiny_file.write_text(json.dumps({"candidates": [tiny]}))
    nested = tmp_path / "nested.json"
    nested.write_text('{"candidates": ' + "[" * 50_000 + "]" * 50_000 + "}")
    calls = [
        ("account", "--candidates", tiny_file, "--method", "rs", "--weights", "1"),
        ("account", "--candidates", nested, "--method", "rs", "--weights", "1"),
        ("account", "--candidates", tmp_path, "--method", "rs", "--weights", "1"),
        ("account", "--candidates", candidates_file, "--method", "rs", "--weights", "1"),
        ("account", "--candidates", candidates_file, "--method", "rs", "--weights", "true"),
        ("study", "mean-estimation", "--sigmas", "1,2", "--targets", "1", "--delta", "1.5"),
        ("study", "mean-estimation", "--sigmas", "1,2", "--targets", "1", "--delta", "1"),
        ("study", "mean-estimation", "--sigmas", "1e300,1", "--targets", "1,2"),
    ]
    for argv in calls:
        argv = [*argv] if "--delta" in argv else [*argv, "--delta", "1e-5"]
        code, out, err = run(capsys, *argv)
        assert code == 2, argv
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    # A label whose own δ exceeds the requested δ: its ε is unbounded there (null + reason in
    # JSON), though a small share of it can still be mixed by RS.
    code, out, _ = run(
        capsys,
        "account",
        "--candidates",
        with_label,
        "--method",
        "rs",
        "--weights",
        "0.5,0.5",
        "--delta",
        "1e-5",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0 and doc["epsilon"] is None and "exceeds δ" in doc["reason"]
    assert doc["reachable_epsilon_range"][1] is None
    for method in ("rs", "lc"):
        code, out, _ = run(
            capsys,
            "account",
            "--candidates",
            with_label,
            "--method",
            method,
            "--target-epsilon",
            "2",
            "--delta",
            "1e-5",
            "--json",
        )
        doc = json.loads(out)
        assert code == 0 and doc["epsilon"] <= 2
    # δ far below the PLD's resolution: the PLD has no finite ε there, RDP still answers.
    code, out, _ = run(
        capsys,
        "account",
        "--candidates",
        candidates_file,
        "--method",
        "lc",
        "--weights",
        "0.5,0.5,0,0",
        "--delta",
        "1e-20",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0 and doc["epsilon_pld"] is None and doc["accountant"] == "rdp"
    assert "no finite ε" in doc["reason"]


def test_account_given_weights_json(capsys, candidates_file):
    code, out, _ = run(
        capsys,
        "account",
        "--candidates",
        candidates_file,
        "--method",
        "lc",
        "--weights",
        "0.5,0.5,0,0",
        "--delta",
        "1e-5",
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    for key in (
        "method",
        "weights",
        "delta",
        "epsilon_pld",
        "epsilon_rdp",
        "bound",
        "generic_epsilon_pld",
        "structured_epsilon_pld",
        "feasible",
        "reachable_epsilon_range",
    ):
        assert key in doc
    assert doc["weights"] == [0.5, 0.5, 0, 0]
    assert doc["bound"] == "generic" and doc["epsilon_pld"] == doc["generic_epsilon_pld"]
    assert doc["structured_epsilon_pld"] < doc["generic_epsilon_pld"]


def test_account_calibrates_structured_and_rs(capsys, candidates_file):
    code, out, _ = run(
        capsys,
        "account",
        "--candidates",
        candidates_file,
        "--method",
        "lc",
        "--target-epsilon",
        "1.0",
        "--delta",
        "1e-5",
        "--bound",
        "structured",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0 and doc["feasible"] and doc["bound"] == "structured"
    assert doc["epsilon"] <= 1.0
    code, out, _ = run(
        capsys,
        "account",
        "--candidates",
        candidates_file,
        "--method",
        "rs",
        "--target-epsilon",
        "1.0",
        "--delta",
        "1e-5",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0 and doc["bound"] == "selection" and doc["epsilon_pld"] <= 1.0
    assert "structured_epsilon_pld" not in doc


def test_infeasible_target(capsys, candidates_file):
    code, out, err = run(
        capsys,
        "account",
        "--candidates",
        candidates_file,
        "--method",
        "lc",
        "--target-epsilon",
        "0.01",
        "--delta",
        "1e-5",
    )
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and "below the most private" in err
    assert "train σ ≥ " in err and "(PLD) to reach ε* = 0.01" in err
    code, out, _ = run(
        capsys,
        "account",
        "--candidates",
        candidates_file,
        "--method",
        "lc",
        "--target-epsilon",
        "0.01",
        "--delta",
        "1e-5",
        "--json",
    )
    doc = json.loads(out)
    assert code == 3 and doc["feasible"] is False
    low, high = doc["reachable_epsilon_range"]
    assert 0.01 < low <= high
    sigma = doc["required_noise_multiplier"]
    assert sigma > 2.0 and f"train σ ≥ {math.ceil(sigma * 1000) / 1000:.3f}" in doc["reason"]


def test_options_that_cannot_apply_are_refused_in_one_line(capsys, candidates_file):
    """--utilities (RS odds never come from accuracies), --segments outside a structured LC
    calibration, and --weights for a mixture: one line, exit 2, nothing on stdout."""
    base = ("account", "--candidates", candidates_file, "--delta", "1e-5")
    calls = [
        ("--method", "rs", "--target-epsilon", "1", "--utilities", "0.80,0.90,0.70,0.60"),
        ("--method", "mixture", "--target-epsilon", "1", "--utilities", "0.8,0.9,0.7,0.6"),
        ("--method", "rs", "--target-epsilon", "1", "--segments"),
        ("--method", "lc", "--target-epsilon", "1", "--segments"),
        ("--method", "lc", "--bound", "structured", "--weights", "1,0,0,0", "--segments"),
        ("--method", "mixture", "--weights", "0.5,0.5,0,0"),
        ("--method", "mixture", "--target-epsilon", "1", "--bound", "structured"),
    ]
    for argv in calls:
        code, out, err = run(capsys, *base, *argv)
        assert code == 2 and out == "", argv
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    code, out, _ = run(capsys, "account", "--help")
    assert code == 0 and "--method" in out
    assert "--utilities" not in out and "validation accurac" not in out


def test_account_calibrates_a_mixture(capsys, candidates_file):
    base = ("account", "--candidates", candidates_file, "--delta", "1e-5", "--method", "mixture")
    code, out, _ = run(capsys, *base, "--target-epsilon", "1.0", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["method"] == "mixture" and doc["bound"] == "mixture"
    assert doc["epsilon"] <= 1.0 and doc["weights"] is None and len(doc["rungs"]) == 2
    assert set(doc["used_candidates"]) == {m for r in doc["rungs"] for m in r["members"]}
    code, out, _ = run(capsys, *base, "--target-epsilon", "1.0")
    assert code == 0 and out.count("  with probability ") == 2
    assert "mixture bound (gates)" in out and "generic bound: PLD" in out


def test_bad_candidates_file_names_the_field(capsys, tmp_path):
    data = candidates_to_document([make_record("a", 1.0)])
    del data["candidates"][0]["batch_lineage"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    code, out, err = run(
        capsys,
        "account",
        "--candidates",
        path,
        "--method",
        "rs",
        "--weights",
        "1",
        "--delta",
        "1e-5",
    )
    assert code == 2 and out == ""
    assert "missing field 'batch_lineage'" in err and err.count("\n") == 1


def test_structured_refusal_is_a_clear_error(capsys, tmp_path):
    shared = [
        make_record("a", 1.0, noise_lineage="run-1", run_id="1"),
        make_record("b", 1.0, steps=1000, noise_lineage="run-1", run_id="1"),
    ]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(candidates_to_document(shared)))
    code, _, err = run(
        capsys,
        "account",
        "--candidates",
        path,
        "--method",
        "lc",
        "--weights",
        "0.5,0.5",
        "--delta",
        "1e-5",
        "--bound",
        "structured",
    )
    assert code == 2 and "share noise lineage" in err


def test_study_mean_estimation_json(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "study",
        "mean-estimation",
        "--sigmas",
        "0.5,1,2,4",
        "--targets",
        "1,8",  # each target's two-dimensional bound takes ~10 CPU-s; two show the rows' order
        "--delta",
        "1e-5",
        "--dimensions",
        "2",
        "--results",
        str(tmp_path),
        "--no-mlflow",
        "--no-progress",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0
    assert [r["target_epsilon"] for r in doc["rows"]] == [1, 8]
    assert {
        "target_epsilon",
        "lc_mse_pld",
        "rs_mse_pld",
        "lc_mse_rdp",
        "rs_mse_rdp",
        "rs_epsilon_mixture_bound",
        "rs_epsilon_exact",
        "rs_mse_exact",
    } <= set(doc["rows"][0])
    assert "lc_mse_measured" not in doc["rows"][0]  # only with --monte-carlo
    assert doc["rows"][0]["lc_mse_rdp"] is None  # RDP cannot reach ε = 1 with σ ≤ 4


def test_help_imports_no_heavy_library():
    """``dpmerge --help`` lists every command without importing torch, MLflow, Prefect or
    dp_accounting (each takes seconds); a command imports only its own module."""
    code = (
        "import sys, contextlib, io\n"
        "import flows.cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    flows.cli.main(['--help'])\n"
        "heavy = [m for m in ('torch', 'mlflow', 'prefect', 'dp_accounting') if m in sys.modules]\n"
        "print(heavy, 'policy' in out.getvalue(), 'account' in out.getvalue())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[] True True"


@pytest.mark.parametrize(
    ("argv", "exit_code"),
    [
        (["policy", "history", "eu", "--json"], 2),  # no such policy
        (["policy", "ls"], 0),
        (["policy", "set", "--name", "eu", "--target-epsilon", "1_0"], 2),
    ],
)
def test_policy_reads_and_refusals_import_no_heavy_library(argv, exit_code, tmp_path):
    """A policy's history, the list, and a refused ``set`` import neither torch nor MLflow,
    Prefect or pandas: they answer in well under a second (they took 5 s when the policy
    package imported the whole workflow)."""
    (tmp_path / "mlflow.db").touch()  # an embedded registry to find; nothing reads it
    code = (
        "import sys\n"
        "import flows.cli\n"
        "try:\n"
        f"    code = flows.cli.main({[*argv, '--home', str(tmp_path)]!r})\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "heavy = [m for m in ('torch', 'mlflow', 'prefect', 'pandas') if m in sys.modules]\n"
        "print(code, heavy, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    code, heavy = result.stderr.splitlines()[-1].split(" ", 1)
    assert heavy == "[]", result.stderr
    assert int(code) == exit_code, result.stderr


def test_reachable_range_is_the_methods_in_every_mode(capsys, tmp_path):
    """LC's range ends at the joint release of every candidate (a shared-batch pair is one
    unit), RS's at the least private candidate — the same whether weights are evaluated or a
    target is calibrated (the mixture's is LC's); a mixture states each assumption once."""
    records = (
        make_record("a", 1.0, steps=100, sample_rate=0.01, batch_lineage="b1"),
        make_record("b", 1.5, steps=50, sample_rate=0.01, batch_lineage="b1"),
        make_record("c", 2.0, steps=200, sample_rate=0.05),
    )
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(candidates_to_document(records)))
    base = ["account", "--candidates", path, "--delta", "1e-5", "--json"]

    def reachable(*argv):
        code, out, _ = run(capsys, *base, *argv)
        assert code == 0
        return json.loads(out)

    evaluated = reachable("--method", "lc", "--weights", "0.3,0.3,0.4")
    calibrated = reachable("--method", "lc", "--target-epsilon", "1.2")
    low, high = evaluated["reachable_epsilon_range"]
    assert [low, high] == calibrated["reachable_epsilon_range"]
    assert high >= evaluated["epsilon"]  # the all-candidates merge lies inside its own range
    rs = reachable("--method", "rs", "--weights", "0.3,0.3,0.4")["reachable_epsilon_range"]
    assert rs[0] == low and rs[1] < high
    mixed = reachable("--method", "mixture", "--target-epsilon", "1.2")
    assert mixed["reachable_epsilon_range"] == [low, high]
    assumptions = mixed["bounds"]["gating"]["assumptions"]
    assert len(assumptions) == len(set(assumptions))


def test_a_closed_pipe_ends_the_command_quietly(candidates_file):
    """``dpmerge account … --json | head`` where the reader has gone: exit 141, no traceback."""
    script = (
        "import sys; from dpmerge.cli import main; "
        f"sys.exit(main(['account', '--candidates', {str(candidates_file)!r}, '--method', 'lc', "
        "'--weights', '0.25,0.25,0.25,0.25', '--delta', '1e-5', '--json']))"
    )
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], stdout=write_end, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141 and b"Traceback" not in done.stderr, done.stderr[-500:]


def test_account_checks_delta_against_a_given_or_recorded_dataset_size(capsys, tmp_path):
    """δ = 0.5 with n = 10,000 gave ε = 0.0000 unchecked: now refused in one line, whether n
    comes from ``--dataset-size`` or from the records; without any n the output says δ was not
    checked."""
    unsized = tmp_path / "unsized.json"
    unsized.write_text(
        json.dumps(candidates_to_document([make_record("a", 1.0, dataset_size=None)]))
    )
    base = ("account", "--candidates", unsized, "--method", "rs", "--weights", "1")
    code, out, err = run(capsys, *base, "--delta", "0.5", "--dataset-size", "10000")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "δ = 0.5 is not below 1/n = 0.0001 for n = 10,000 training rows" in err
    code, out, err = run(capsys, *base, "--delta", "5e-5", "--dataset-size", "10000", "--json")
    assert code == 0 and json.loads(out)["delta_check"]["dataset_size"] == 10_000
    assert err.startswith("dpmerge: warning: δ = 5e-05 is above 1/(10·n) = 1e-05")
    code, out, err = run(capsys, *base, "--delta", "0.5")
    assert code == 0 and err == ""
    assert "note: δ = 0.5 was not checked against the dataset size" in out
    sized = tmp_path / "sized.json"
    sized.write_text(json.dumps(candidates_to_document([make_record("a", 1.0)])))
    code, out, err = run(
        capsys, "account", "--candidates", sized, "--method", "rs", "--weights", "1",
        "--delta", "1e-3",
    )  # fmt: skip
    assert code == 2 and out == "" and "n = 60,000 training rows" in err
    for bad in ("0", "-5", "1e4", "2.5", "true"):
        code, out, err = run(capsys, *base, "--delta", "1e-6", "--dataset-size", bad)
        assert code == 2 and out == "" and "Traceback" not in err, bad
