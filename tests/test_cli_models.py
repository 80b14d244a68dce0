"""``dpmerge merge``, ``evaluate`` and ``candidates`` through the real dispatcher."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from factories import make_record

from dpmerge import cli
from dpmerge.accounting.records import MechanismRecord, load_candidates
from dpmerge.artifacts import ModelSpec, load_model_dir, save_model_dir
from dpmerge.data import load_dataset
from dpmerge.models import build_model

DIGITS = load_dataset("digits")
SPEC = ModelSpec("logreg", DIGITS.input_shape, DIGITS.num_classes)


def record(name: str, sigma: float, dataset: str = DIGITS.fingerprint) -> MechanismRecord:
    return make_record(
        name, sigma, steps=50, sample_rate=0.05, learning_rate=0.5, batch=64.0, dataset=dataset
    )


def class_means_weights(scale: float) -> dict[str, torch.Tensor]:
    """A nearest-class-mean-like classifier, so accuracies differ from chance."""
    features, labels = DIGITS.train.features.flatten(1), DIGITS.train.labels
    means = torch.stack([features[labels == c].mean(0) for c in range(10)])
    return {"linear.weight": scale * means, "linear.bias": -0.5 * scale * (means**2).sum(1)}


@pytest.fixture
def candidates(tmp_path: Path) -> list[Path]:
    return [
        save_model_dir(tmp_path / name, class_means_weights(scale), SPEC, record=record(name, s))
        for name, scale, s in [("a", 1.0, 1.0), ("b", 0.2, 2.0)]
    ]


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_lc_merge_with_weights_prints_the_release(tmp_path, candidates, capsys) -> None:
    out = tmp_path / "lc"
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "lc", "--weights", "0.25,0.75",
        "--out", out, "--json",
    )  # fmt: skip
    assert code == 0
    document = json.loads(stdout)
    assert document["weights"] == [0.25, 0.75] and document["path"] == str(out)
    assert document["privacy"]["bound"] == "generic" and document["privacy"]["epsilon"] > 0
    assert load_model_dir(out).merge["weights"] == [0.25, 0.75]

    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "lc", "--weights", "1,0",
        "--out", tmp_path / "lc2",
    )  # fmt: skip
    assert code == 0 and "released LC merge of 2 candidates" in stdout and "λ: a=1, b=0" in stdout
    assert "warning" not in stdout  # both start from seed-0


def test_explicit_weights_across_initialisations_merge_and_say_so(tmp_path, capsys) -> None:
    """``--weights`` is the user's choice, so it merges; the warning the card carries is
    printed too (docs/design.md#sharp-edges)."""
    inputs = [
        save_model_dir(
            tmp_path / name,
            class_means_weights(1.0),
            SPEC,
            record=make_record(
                name, 1.0, steps=50, sample_rate=0.05, batch=64.0, dataset=DIGITS.fingerprint,
                initialisation=start,
            ),
        )
        for name, start in [("a", "seed-0"), ("b", "seed-1")]
    ]  # fmt: skip
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *inputs, "--method", "lc", "--weights", "0.5,0.5",
        "--out", tmp_path / "lc",
    )  # fmt: skip
    assert code == 0 and "released LC merge of 2 candidates" in stdout
    assert (
        "  warning: candidates start from different initialisations ('a' (seed-0), 'b' (seed-1))"
    ) in stdout


def test_calibrated_lc_merge_evaluates_on_the_test_split(tmp_path, candidates, capsys) -> None:
    out = tmp_path / "lc"
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "lc", "--target-epsilon", "50",
        "--dataset", "digits", "--out", out, "--json",
    )  # fmt: skip
    assert code == 0
    document = json.loads(stdout)
    assert document["calibration"]["target_epsilon"] == 50
    assert document["privacy"]["epsilon"] <= 50
    merged = load_model_dir(out)
    assert merged.merge["calibration"]["target_epsilon"] == 50
    assert merged.metrics["dataset"] == "digits"
    assert merged.metrics["test"]["n"] == len(DIGITS.test)
    assert merged.metrics["test"]["accuracy"] > 0.5


def test_rs_merge_keeps_the_draw_out_of_stdout_and_the_release(
    tmp_path, candidates, capsys
) -> None:
    out, audit = tmp_path / "rs", tmp_path / "audit.json"
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "rs", "--weights", "0.5,0.5",
        "--dataset", "digits", "--audit-file", audit, "--out", out, "--json",
    )  # fmt: skip
    assert code == 0
    assert "drawn_index" not in stdout and "expected_test_accuracy" not in stdout
    record = json.loads(audit.read_text())
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    drawn = record["drawn_index"]
    accuracies = record["notes"]["candidate_test_accuracies"]
    assert record["notes"]["expected_test_accuracy"] == pytest.approx(sum(accuracies) / 2)
    released = load_model_dir(out)
    assert released.metrics["test"]["accuracy"] == pytest.approx(accuracies[drawn])
    assert "drawn_index" not in json.dumps([released.merge, released.privacy, released.metrics])

    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "rs", "--weights", "0.5,0.5",
        "--out", tmp_path / "rs2",
    )  # fmt: skip
    assert code == 0 and "drawn candidate: secret (not recorded)" in stdout


def test_rs_merge_never_reads_validation_accuracy(tmp_path, candidates, capsys, monkeypatch):
    """π comes from the records' noise proxy: with --dataset, only the released model is
    evaluated, on the test split (the audit found RS steered by validation accuracies)."""
    from dpmerge.cli import models

    splits = []
    real = models.evaluate

    def recording(model, split, **kwargs):
        splits.append(split)
        return real(model, split, **kwargs)

    monkeypatch.setattr(models, "evaluate", recording)
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "rs", "--target-epsilon", "1.5",
        "--dataset", "digits", "--out", tmp_path / "rs", "--json",
    )  # fmt: skip
    assert code == 0
    calibration = json.loads(stdout)["calibration"]
    assert calibration["utility_kind"].startswith("noise proxy")
    assert splits and all(split is not DIGITS.validation for split in splits)
    assert all(len(split) == len(DIGITS.test) for split in splits)
    code, _, err = run(
        capsys, "merge", "--inputs", *candidates, "--method", "rs", "--target-epsilon", "1.5",
        "--dataset", "digits", "--tune-weights", "--out", tmp_path / "rs2",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "--tune-weights" in err
    assert not (tmp_path / "rs2").exists()


def test_mixture_merge_releases_one_of_two_lc_merges(tmp_path, candidates, capsys) -> None:
    out, audit = tmp_path / "mix", tmp_path / "audit.json"
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "mixture", "--target-epsilon",
        "1.5", "--dataset", "digits", "--audit-file", audit, "--out", out, "--json",
    )  # fmt: skip
    assert code == 0
    document = json.loads(stdout)
    privacy = document["privacy"]
    assert privacy["method"] == "mixture" and privacy["epsilon"] <= 1.5
    assert len(privacy["rungs"]) == 2 and document["weights"] is None
    drawn = json.loads(audit.read_text())["drawn_index"]
    assert "drawn_" not in json.dumps([load_model_dir(out).merge, privacy])
    assert drawn in (0, 1)
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "mixture", "--target-epsilon",
        "1.5", "--out", tmp_path / "mix2",
    )  # fmt: skip
    assert code == 0 and stdout.count("with probability") == 2
    assert "drawn merge: secret (not recorded)" in stdout
    code, _, err = run(
        capsys, "merge", "--inputs", *candidates, "--method", "mixture", "--weights", "0.5,0.5",
        "--out", tmp_path / "mix3",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "--target-epsilon" in err


def test_errors_print_one_line_and_write_nothing(tmp_path, candidates, capsys) -> None:
    out = tmp_path / "out"
    code, _, stderr = run(
        capsys, "merge", "--inputs", *candidates, "--method", "lc", "--weights", "0.5,0.6",
        "--out", out,
    )  # fmt: skip
    assert code == 2 and "simplex" in stderr and stderr.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        run(
            capsys, "merge", "--inputs", *candidates, "--method", "lc", "--weights", "half,half",
            "--out", out,
        )  # fmt: skip
    assert exit_info.value.code == 2 and "comma-separated" in capsys.readouterr().err
    code, _, stderr = run(
        capsys, "merge", "--inputs", *candidates, "--method", "rs", "--weights", "0.5,0.5",
        "--bound", "structured", "--out", out,
    )  # fmt: skip
    assert code == 2 and "LC only" in stderr
    code, _, stderr = run(
        capsys, "merge", "--inputs", *candidates, "--method", "lc", "--target-epsilon", "0.01",
        "--out", out,
    )  # fmt: skip
    assert code == 3 and "infeasible" in stderr
    other = save_model_dir(
        tmp_path / "c", class_means_weights(1.0), SPEC, record=record("c", 1.0, "digits-other")
    )
    code, _, stderr = run(
        capsys, "merge", "--inputs", candidates[0], other, "--method", "lc", "--tune-weights",
        "--target-epsilon", "50", "--dataset", "digits", "--out", out,
    )  # fmt: skip
    assert code == 2 and "validation split is disjoint" in stderr
    assert not out.exists()


def test_evaluate_prints_the_model_metrics(tmp_path, candidates, capsys) -> None:
    code, stdout, _ = run(capsys, "evaluate", candidates[0], "--dataset", "digits", "--json")
    assert code == 0
    document = json.loads(stdout)
    assert document["split"] == "test" and document["n"] == len(DIGITS.test)
    assert len(document["per_class_accuracy"]) == 10 and 0.5 < document["accuracy"] <= 1
    code, stdout, _ = run(
        capsys, "evaluate", candidates[0], "--dataset", "digits", "--split", "validation"
    )
    assert code == 0 and f"on digits/validation (n = {len(DIGITS.validation)})" in stdout


def test_evaluate_refuses_a_validation_split_that_may_overlap_training(tmp_path, capsys) -> None:
    zero = {k: torch.zeros_like(v) for k, v in build_model(SPEC).state_dict().items()}
    model = save_model_dir(tmp_path / "m", zero, SPEC, record=record("m", 1.0, "digits-other"))
    code, _, stderr = run(capsys, "evaluate", model, "--dataset", "digits", "--split", "validation")
    assert code == 2 and "trained on digits-other" in stderr


def test_candidates_prints_the_file_account_reads(tmp_path, candidates, capsys) -> None:
    code, stdout, _ = run(capsys, "candidates", "list", *candidates)
    assert code == 0
    path = tmp_path / "candidates.json"
    path.write_text(stdout)
    assert load_candidates(path) == (record("a", 1.0), record("b", 2.0))
    code, stdout, _ = run(
        capsys, "account", "--candidates", path, "--method", "lc", "--weights", "0.5,0.5",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    accounted = json.loads(stdout)["epsilon"]
    merged = tmp_path / "merged"
    code, stdout, _ = run(
        capsys, "merge", "--inputs", *candidates, "--method", "lc", "--weights", "0.5,0.5",
        "--out", merged, "--json",
    )  # fmt: skip
    assert json.loads(stdout)["privacy"]["epsilon"] == accounted
    code, _, stderr = run(capsys, "candidates", "list", candidates[0], merged)
    assert code == 2 and "a merged model, not a candidate" in stderr


def test_merge_refuses_a_delta_of_one_over_n_or_more(tmp_path, candidates, capsys) -> None:
    """δ = 1e-3 on 60,000 rows would permit releasing rows in the clear: refused naming n,
    nothing written; δ = 1e-5 passes with a warning (above 1/(10·n))."""
    base = ("merge", "--inputs", *candidates, "--method", "lc", "--weights", "0.5,0.5")
    out = tmp_path / "lc"
    code, stdout, err = run(capsys, *base, "--delta", "1e-3", "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "δ = 0.001 is not below 1/n = 1.67e-05 for n = 60,000 training rows" in err
    code, stdout, err = run(capsys, *base, "--delta", "1e-5", "--out", out)
    assert code == 0 and out.is_dir()
    assert err == (
        "dpmerge: warning: δ = 1e-05 is above 1/(10·n) = 1.67e-06 for n = 60,000 training "
        "rows: a weak guarantee (δ < 1/n = 1.67e-05 is the least a release needs; δ ≤ 1.67e-06 "
        "is usual)\n"
    )


def test_merge_refuses_a_delta_it_cannot_check_against_n(tmp_path, capsys) -> None:
    """A record without dataset_size: the merge is refused unless --dataset-size gives n, and
    then δ is checked against it (nothing written on a refusal)."""
    unsized = make_record("u", 1.0, steps=50, sample_rate=0.05, dataset=DIGITS.fingerprint,
                          dataset_size=None)  # fmt: skip
    directory = save_model_dir(tmp_path / "u", class_means_weights(1.0), SPEC, record=unsized)
    base = ("merge", "--inputs", directory, "--method", "lc", "--weights", "1", "--delta", "1e-6")
    out = tmp_path / "lc"
    code, stdout, err = run(capsys, *base, "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and "give --dataset-size" in err
    code, stdout, err = run(capsys, *base, "--dataset-size", "1000000", "--out", out)
    assert code == 2 and not out.exists() and "n = 1,000,000 training rows" in err
    code, stdout, err = run(capsys, *base, "--dataset-size", "100000", "--out", out)
    assert code == 0 and out.is_dir() and err == ""
