"""``dpmerge study …`` end to end on tiny configurations: the files, their values, MLflow,
resumability and bad input (docs/design.md#studies)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

import dpmerge.cli
from dpmerge.accounting.candidate import candidate_bound, dpsgd_epsilon_pld
from dpmerge.artifacts import load_model_dir
from dpmerge.data import load_dataset
from dpmerge.registry.studies import STUDIES_EXPERIMENT


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = dpmerge.cli.main(["study", *argv])
    except SystemExit as stop:  # argparse's refusals exit (with one line, see OneLineParser)
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def logged_run(tracking: str, run_id: str) -> tuple[dict, list[str]]:
    client = MlflowClient(tracking)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == STUDIES_EXPERIMENT
    assert run.info.status == "FINISHED"
    return run.data.metrics, [f.path for f in client.list_artifacts(run_id)]


def unit_times(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in (folder / "units").rglob("*") if p.is_file()}


# --- mean estimation ------------------------------------------------------------------------


def test_mean_estimation_measures_the_formula_and_brackets_rs(tmp_path, capsys, tracking):
    argv = [
        "mean-estimation",
        "--sigmas",
        "1,2,4",
        "--targets",
        "0.5,1,3",
        "--delta",
        "1e-5",
        "--monte-carlo",
        "4000",
        "--dimensions",
        "10",
        "--results",
        str(tmp_path / "me"),
        "--tracking-uri",
        tracking,
        "--json",
        "--no-progress",
    ]
    code, out, _ = run(capsys, *argv)
    document = json.loads(out)
    assert code == 0 and document["units_computed"] == 3
    rows = {r["target_epsilon"]: r for r in document["rows"]}
    assert rows[0.5]["lc_mse_pld"] is None and rows[0.5]["rs_mse_exact"] is None  # infeasible
    for target in (1, 3):
        row = rows[target]
        for name in ("lc", "rs"):
            formula, measured = row[f"{name}_mse_pld"], row[f"{name}_mse_measured"]
            assert abs(measured - formula) <= 5 * row[f"{name}_mse_measured_se"]
        # the chosen RS meets its target under the bound; the exact ε is no larger
        assert row["rs_epsilon_mixture_bound"] <= target + 1e-6
        assert row["rs_epsilon_exact_lower"] <= row["rs_epsilon_exact"]
        assert row["rs_epsilon_exact"] <= row["rs_epsilon_mixture_bound"] + 1e-6
        # a 10-dimensional release lies between the scalar release and the bound (its lower
        # bound is binned in two dimensions, so slightly looser than the scalar one)
        assert row["rs_epsilon_exact_lower"] - 1e-4 <= row["rs_epsilon_d10_lower"]
        assert row["rs_epsilon_d10_lower"] <= row["rs_epsilon_mixture_bound"] + 1e-6
        assert row["rs_epsilon_exact_of_best"] <= target
        assert row["rs_mse_exact"] <= row["rs_mse_pld"] + 1e-9
        assert row["lc_mse_rdp"] is None or row["lc_mse_rdp"] >= row["lc_mse_pld"]
    folder = tmp_path / "me"
    for name in (
        "mean_estimation.csv",
        "mean_estimation.md",
        "mse_vs_epsilon.png",
        "rs_exact_vs_bound.png",
    ):
        assert (folder / name).stat().st_size > 500
    metrics, artifacts = logged_run(tracking, document["mlflow_run_id"])
    assert metrics["lc_mse_pld"] > 0 and "mean_estimation.csv" in artifacts
    before = unit_times(folder)
    code, out, _ = run(capsys, *argv)
    again = json.loads(out)
    assert again["units_computed"] == 0 and again["units_reused"] == 3
    assert again["rows"] == document["rows"] and unit_times(folder) == before


# --- convex frontier ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_frontier(tmp_path_factory, tracking):
    folder = tmp_path_factory.mktemp("frontier")
    argv = [
        "frontier",
        "--quick",
        "--seeds",
        "2",
        "--grid",
        "3",
        "--epochs",
        "4",
        "--results",
        str(folder),
        "--tracking-uri",
        tracking,
        "--json",
        "--no-progress",
    ]
    code = dpmerge.cli.main(["study", *argv])
    assert code == 0
    return folder, argv


def test_frontier_points_meet_their_targets(quick_frontier, capsys):
    folder, _ = quick_frontier
    table = pd.read_csv(folder / "frontier.csv")
    merges = {"rs", "lc-generic", "mixture", "auto", "lc-structured"}
    assert {"candidate", "retrain", *merges} <= set(table.kind)
    assert {k for k in set(table.kind) - merges if k not in ("candidate", "retrain")} == {
        f"retrain-matched-m{m}" for m in set(table.members[table.kind.isin(merges)]) if m > 1
    }
    assert set(table.seed) == {0, 1}
    targets = sorted(table.target_epsilon.dropna().unique())
    assert len(targets) == 3
    candidates = table[table.kind == "candidate"]
    assert targets[0] == pytest.approx(candidates.epsilon.min())
    assert targets[-1] == pytest.approx(candidates.epsilon.max())
    points = table[table.kind != "candidate"]
    assert (points.epsilon <= points.target_epsilon + 1e-12).all()
    assert points.epsilon_pld.notna().all() and points.epsilon_rdp.notna().all()
    assert ((table.test_accuracy > 0.1) & (table.test_accuracy <= 1)).all()
    rs = points[points.kind == "rs"]
    assert rs.drawn_test_accuracy.isin(candidates.test_accuracy.values).all()
    # The mixture names both merges and their odds; auto repeats the row of what it chose.
    for row in points[points.kind == "mixture"].itertuples():
        rungs = json.loads(row.weights)
        assert row.method == "mixture" and sum(r["probability"] for r in rungs) == pytest.approx(1)
    for row in points[points.kind == "auto"].itertuples():
        chosen = points[
            (points.kind == ("lc-generic" if row.method == "lc" else row.method))
            & (points.seed == row.seed)
            & (points.target_epsilon == row.target_epsilon)
        ].iloc[0]
        assert (row.epsilon, row.test_accuracy, row.weights) == (
            chosen.epsilon,
            chosen.test_accuracy,
            chosen.weights,
        )


def test_frontier_retrains_spend_the_target_and_match_each_merges_compute(quick_frontier):
    folder, _ = quick_frontier
    table = pd.read_csv(folder / "frontier.csv")
    models = {
        load_model_dir(p).record.name: load_model_dir(p)
        for p in (folder / "units").iterdir()
        if p.is_dir() and p.name.startswith("model-retrain")
    }
    assert models
    for model in models.values():
        record = model.record
        row = table[table.candidates == json.dumps([record.name])].iloc[0]
        target = row.target_epsilon
        epsilon = candidate_bound(record, 1e-5).epsilon_pld
        assert 0.999 * target <= epsilon <= target  # spends the target (σ to 1e-4)
        assert dpsgd_epsilon_pld(record.noise_multiplier * 0.999, record.sample_rate,
                                 record.steps, 1e-5) > target  # fmt: skip
    merges = table[table.kind.isin(["rs", "lc-generic", "mixture", "auto", "lc-structured"])]
    for row in merges[merges.members > 1].itertuples():
        retrain = table[
            (table.kind == f"retrain-matched-m{row.members}")
            & (table.seed == row.seed)
            & (table.target_epsilon == row.target_epsilon)
        ].iloc[0]
        share = retrain.per_example_gradients / row.per_example_gradients
        assert share == pytest.approx(1.0, rel=0.05)
    gaps = pd.read_csv(folder / "gaps.csv")
    assert set(gaps.reference) == {"retrain", "retrain-matched"}
    assert (gaps.ci_low <= gaps.gap).all() and (gaps.gap <= gaps.ci_high).all()
    assert (gaps.seeds == 2).all()


def test_frontier_files_logging_and_resume(quick_frontier, capsys, tracking):
    folder, argv = quick_frontier
    for name in (
        "frontier.csv",
        "summary.csv",
        "gaps.csv",
        "frontier.md",
        "frontier.png",
        "gap.png",
    ):
        assert (folder / name).stat().st_size > 500
    summary = pd.read_csv(folder / "summary.csv")
    merges = summary[summary.kind == "lc-structured"]
    assert (merges.seeds == 2).all() and merges.test_accuracy_std.notna().all()
    assert "± " in (folder / "frontier.md").read_text()
    before = unit_times(folder)
    code, out, _ = run(capsys, *argv)
    document = json.loads(out)
    assert code == 0 and document["units_computed"] == 0 and document["units_reused"] > 0
    assert unit_times(folder) == before
    # The verdict counts each method's targets above, at least at and below the retrain, as
    # gaps.csv has them; the rest are ties.
    gaps = pd.read_csv(folder / "gaps.csv")
    plain = gaps[(gaps.kind == "auto") & (gaps.reference == "retrain")]
    verdict = document["summary"]
    assert verdict["targets"] == len(plain) == 3
    assert verdict["auto >= retrain"] == (plain.gap >= 0).sum()
    assert verdict["auto significantly above retrain"] == (plain.ci_low > 0).sum()
    assert verdict["auto significantly below retrain"] == (plain.ci_high < 0).sum()
    assert "* auto significantly above retrain: " in (folder / "frontier.md").read_text()
    metrics, artifacts = logged_run(tracking, document["mlflow_run_id"])
    assert 0 < metrics["convex/lc-generic/test_accuracy"] <= 1
    assert {"frontier.csv", "frontier.md", "frontier.png", "gap.png"} <= set(artifacts)


def test_frontier_with_kept_checkpoints(tmp_path, capsys):
    """Each run's kept epochs are candidates of one run (one run id, steps per epoch); the
    grid still runs between the runs' ends; merges count runs, not checkpoints; the retrain is
    also reported averaged over its own checkpoints at its own ε."""
    argv = ["frontier", "--dataset", "digits", "--sigmas", "1,3", "--epochs", "2",
            "--checkpoints", "1,2", "--batch-size", "64", "--seeds", "1", "--grid", "2",
            "--no-structured", "--no-compute-matched", "--results", str(tmp_path / "ck"),
            "--no-mlflow", "--json", "--no-progress"]  # fmt: skip
    code, _, _ = run(capsys, *argv)
    assert code == 0
    table = pd.read_csv(tmp_path / "ck" / "frontier.csv")
    candidates = table[table.kind == "candidate"]
    assert len(candidates) == 4
    runs = [
        load_model_dir(p).record
        for p in (tmp_path / "ck" / "units").glob("run-convex-*/e*")
        if p.is_dir()
    ]
    assert len({r.run_id for r in runs}) == 2 and sorted({r.steps for r in runs})[1] == 2 * min(
        r.steps for r in runs
    )
    ends = candidates.groupby("noise_multiplier").epsilon.max()
    targets = sorted(table.target_epsilon.dropna().unique())
    assert targets == pytest.approx(sorted(ends))
    merges = table[table.kind.isin(["rs", "lc-generic", "mixture", "auto"])]
    assert (merges.epsilon <= merges.target_epsilon + 1e-12).all()
    assert merges.members.max() <= 2
    averaged = table[table.kind == "retrain-averaged"]
    plain = table[table.kind == "retrain"]
    assert len(averaged) == len(plain) == 2
    assert list(averaged.epsilon) == list(plain.epsilon)
    assert "retrain-averaged" in set(pd.read_csv(tmp_path / "ck" / "gaps.csv").reference)


# --- non-convex and pretrained --------------------------------------------------------------


def test_non_convex_probes_start_and_end_at_the_candidates(tmp_path, capsys):
    argv = [
        "non-convex",
        "--dataset",
        "digits",
        "--sigmas",
        "0.8,1.5",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--grid",
        "2",
        "--path-points",
        "3",
        "--results",
        str(tmp_path / "nc"),
        "--no-mlflow",
        "--json",
        "--no-progress",
    ]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    table = pd.read_csv(tmp_path / "nc" / "nonconvex.csv")
    probes = pd.read_csv(tmp_path / "nc" / "probes.csv")
    for group in ("shared", "independent"):
        candidates = table[(table.group == group) & (table.kind == "candidate")]
        path = probes[(probes.group == group) & (probes.probe == "path")].sort_values("t")
        least_noisy = candidates.sort_values("epsilon").test_accuracy.tolist()
        assert path.test_accuracy.iloc[0] == pytest.approx(least_noisy[-1])
        assert path.test_accuracy.iloc[-1] == pytest.approx(least_noisy[-2])
        merges = table[(table.group == group) & (table.kind != "candidate")]
        assert (merges.epsilon <= merges.target_epsilon + 1e-12).all()
    inits = {
        load_model_dir(p).record.initialisation
        for p in (tmp_path / "nc" / "units").iterdir()
        if p.is_dir() and "-independent-" in p.name
    }
    assert len(inits) == 2  # independent initialisations
    assert (tmp_path / "nc" / "paths.png").stat().st_size > 500
    code, out, _ = run(capsys, *argv)
    assert json.loads(out)["units_computed"] == 0


def write_cifar(folder: Path, per_batch: int) -> None:
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, per_batch).tolist(),
        }
        (folder / name).write_bytes(pickle.dumps(batch))


def test_non_convex_runs_resnet18_gn_on_cifar_format_data(tmp_path, capsys):
    write_cifar(tmp_path, 8)
    code, _, _ = run(
        capsys,
        "non-convex",
        "--model",
        "resnet18-gn",
        "--dataset",
        "cifar10",
        "--data-root",
        str(tmp_path),
        "--device",
        "cpu",
        "--sigmas",
        "1,2",
        "--max-steps",
        "1",
        "--batch-size",
        "8",
        "--targets",
        "5",
        "--path-points",
        "2",
        "--no-structured",
        "--no-retrain",
        "--results",
        str(tmp_path / "r"),
        "--no-mlflow",
        "--json",
        "--no-progress",
    )
    assert code == 0
    table = pd.read_csv(tmp_path / "r" / "nonconvex.csv")
    assert set(table.kind) == {"candidate", "rs", "lc-generic", "mixture", "auto"}
    model = next(p for p in (tmp_path / "r" / "units").iterdir() if p.is_dir())
    assert load_model_dir(model).spec.name == "resnet18_gn"


def test_pretrained_fine_tunes_from_public_rows(tmp_path, capsys):
    argv = [
        "pretrained",
        "--dataset",
        "digits",
        "--model",
        "logreg",
        "--public-rows",
        "300",
        "--sigmas",
        "0.8,2",
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--grid",
        "2",
        "--results",
        str(tmp_path / "pt"),
        "--no-mlflow",
        "--json",
        "--no-progress",
    ]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    table = pd.read_csv(tmp_path / "pt" / "pretrained.csv")
    public = table[table.kind == "public-init"]
    assert len(public) == 1 and public.epsilon.iloc[0] == 0 and public.test_accuracy.iloc[0] > 0.3
    models = [
        load_model_dir(p)
        for p in (tmp_path / "pt" / "units").iterdir()
        if p.is_dir() and p.name.startswith("model-")
    ]
    assert {m.record.initialisation for m in models} == {
        models[0].record.initialisation
    } and models[0].record.initialisation.startswith("checkpoint:")
    private_rows = load_dataset("digits").dataset_size - 300
    assert {m.record.dataset_size for m in models} == {private_rows}
    merges = table[~table.kind.isin(["candidate", "public-init"])]
    assert (merges.epsilon <= merges.target_epsilon + 1e-12).all()
    summary = json.loads(out)["summary"]
    assert summary["points (seed × target)"] == 3  # the grid of 2 and the top rung
    top = merges.target_epsilon.max()
    assert top > table[table.kind == "candidate"].epsilon.max()  # all candidates composed


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["frontier", "--seeds", "0"], "--seeds"),
        (["frontier", "--sigmas", "1"], "at least two positive σ"),
        (["frontier", "--dataset", "nope"], "unknown dataset 'nope'"),
        (["frontier", "--quick", "--targets=-1,2"], "targets must be positive"),
        (["frontier", "--grid", "2.5"], "--grid"),
        (["frontier", "--grid", "1"], "grid must be at least 2"),
        (["frontier", "--checkpoints", "3,4"], "including the last (10)"),
        (
            ["mean-estimation", "--sigmas", "1,-1", "--targets", "1", "--delta", "1e-5"],
            "noise multipliers must lie in",
        ),
        (
            [
                "mean-estimation",
                "--sigmas",
                "1",
                "--targets",
                "1",
                "--delta",
                "1e-5",
                "--monte-carlo",
                "true",
            ],
            "--monte-carlo",
        ),
        (
            [
                "mean-estimation",
                "--sigmas",
                "1",
                "--targets",
                "1",
                "--delta",
                "1e-5",
                "--dimensions",
                "1",
            ],
            "dimensions must be at least 2",
        ),
        (["non-convex", "--dataset", "digits", "--model", "mlp"], "unknown model 'mlp'"),
        (["non-convex", "--dataset", "cifar10"], "no folder given for cifar10"),
        (["non-convex", "--dataset", "digits", "--device", "cuda"], "CUDA is not available"),
        (["pretrained", "--dataset", "digits", "--public-rows", "5000"], "no private training"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    code, _, err = run(capsys, *argv, "--results", str(tmp_path / "out"), "--no-mlflow")
    lines = err.strip().splitlines()
    assert code == dpmerge.cli.EXIT_BAD_INPUT
    assert len(lines) == 1 and lines[0].startswith("dpmerge: error:") and message in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_results_file_every_target_infeasible_and_ctrl_c_are_one_line(
    tmp_path, capsys, monkeypatch
):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    code, _, err = run(capsys, "frontier", "--quick", "--results", str(taken), "--no-mlflow")
    assert code == 2 and err.count("\n") == 1 and "is a file, not a folder" in err
    assert taken.read_text() == "a file"
    low = str(tmp_path / "low")
    argv = ["frontier", "--quick", "--seeds", "1", "--epochs", "1", "--targets", "0.001",
            "--no-structured", "--results", low, "--no-mlflow", "--no-progress"]  # fmt: skip
    code, _, err = run(capsys, *argv)
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert "every target (0.001) is below the most private candidate" in err
    assert not list((tmp_path / "low").glob("*.png"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    from dpmerge.studies import convex

    monkeypatch.setattr(convex, "run_frontier_study", interrupted)
    code, _, err = run(capsys, "frontier", "--quick", "--results", str(tmp_path / "r"))
    assert code == 130 and err.count("\n") == 1 and "interrupted" in err and "resume" in err


# --- figures ------------------------------------------------------------------------------------


@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure the study code saves, kept open for inspection."""
    from matplotlib import pyplot as plt
    from matplotlib.figure import Figure

    kept, real_save, real_close = [], Figure.savefig, plt.close

    def save(self, *args, **kwargs):
        kept.append((self, Path(args[0])))
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    monkeypatch.setattr(plt, "close", lambda *args, **kwargs: None)
    yield kept
    for canvas, _ in kept:
        real_close(canvas)


def pixels(canvas) -> np.ndarray:
    canvas.canvas.draw()
    return np.asarray(canvas.canvas.buffer_rgba()).copy()


def check_readable(canvas, path: Path) -> None:
    """The PNG has a sensible size; every title lies inside the canvas; every legend entry's
    line shows somewhere (hiding it clearly changes pixels, more than the antialiased edges of
    a line on top would); no legend covers a data point."""
    from matplotlib import image

    height, width = image.imread(path).shape[:2]
    assert width >= 600 and height >= 300 and path.stat().st_size > 10_000
    renderer = canvas.canvas.get_renderer()
    inside = canvas.bbox
    texts = [a.title for a in canvas.axes] + ([canvas._suptitle] if canvas._suptitle else [])
    for text in texts:
        if text.get_text():
            box = text.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= inside.x1 and box.y1 <= inside.y1, text.get_text()
    for axes in canvas.axes:
        legend = axes.get_legend()
        handles, labels = axes.get_legend_handles_labels()
        assert legend is not None and len(handles) >= 2
        before = pixels(canvas)
        for handle, label in zip(handles, labels, strict=True):
            parts = handle.get_children() if hasattr(handle, "get_children") else [handle]
            parts = [p for p in parts if p.get_visible()] or [handle]
            for part in parts:
                part.set_visible(False)
            difference = np.abs(pixels(canvas).astype(int) - before.astype(int)).max(axis=2)
            changed = int((difference > 80).sum())  # not just antialiased edges
            for part in parts:
                part.set_visible(True)
            assert changed >= 20, f"{path.name}: {label!r} is hidden under other lines"
        box = legend.get_window_extent(renderer)
        for line in axes.get_lines():
            for x, y in axes.transData.transform(line.get_xydata()):
                assert not box.contains(x, y), f"{path.name}: the legend covers data"


def frontier_table(groups: bool) -> pd.DataFrame:
    """A frontier where several methods coincide (as in the non-convex 'independent' panel)."""
    rows = []
    for group in ("shared", "independent") if groups else ("one",):
        for i in range(3):
            rows.append(dict(group=group, kind="candidate", epsilon=0.2 * 2**i,
                             test_accuracy=0.8 + 0.01 * i, delta=1e-5))  # fmt: skip
        for kind in ("rs", "lc-generic", "mixture", "auto", "lc-structured"):
            for t, target in enumerate((0.2, 0.4, 0.8)):
                lift = 0.0 if group == "independent" or kind == "rs" else 0.003 * t
                rows.append(dict(group=group, kind=kind, epsilon=target, delta=1e-5,
                                 test_accuracy=0.79 + 0.01 * t + lift))  # fmt: skip
    table = pd.DataFrame(rows)
    return table if groups else table.drop(columns="group")


def test_figures_are_readable(tmp_path, saved_figures):
    from dpmerge.studies.engine import plot_gaps
    from dpmerge.studies.frontier import plot_frontier
    from dpmerge.studies.mean_estimation_study import MeanEstimationStudy, _plot_exact

    long_title = (
        "dpmerge-fashion-mnist-0123abcd-logreg-candidates: accuracy vs certified ε (δ = 1e-05)"
    )
    plot_frontier(frontier_table(False), tmp_path / "pareto.png", long_title)
    plot_frontier(frontier_table(True), tmp_path / "nonconvex.png", long_title)
    gaps = pd.DataFrame(
        [
            dict(
                kind=kind,
                reference="retrain",
                target_epsilon=target,
                gap=gap,
                ci_low=gap - 0.004,
                ci_high=gap + 0.004,
            )
            for kind, shift in (("auto", 0.0), ("mixture", 0.0), ("lc-generic", -0.01))
            for target, gap in ((0.25, 0.001 + shift), (0.4, 0.004 + shift), (0.9, 0.02 + shift))
        ]
    )
    plot_gaps(gaps, tmp_path / "gap.png", "merge minus retrain at the target, same seed (95 % CI)")
    exact = pd.DataFrame(
        dict(
            target_epsilon=[1.0, 2.0, 4.0],
            rs_epsilon_mixture_bound=[1.0, 2.0, 4.0],
            rs_epsilon_exact=[0.93, 1.99, 1.96],
            rs_epsilon_d2_lower=[0.93, 1.99, 1.96],  # equal to the scalar release's
            rs_epsilon_d100_lower=[1.0, 2.0, 4.0],  # equal to the bound
        )
    )
    study = MeanEstimationStudy(sigmas=(0.5, 1.0), targets=(1.0, 2.0, 4.0), delta=1e-5,
                                dimensions=(2, 100))  # fmt: skip
    _plot_exact(exact, tmp_path / "exact.png", study)
    assert len(saved_figures) == 4
    for canvas, path in saved_figures:
        check_readable(canvas, path)
