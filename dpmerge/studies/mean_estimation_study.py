"""The mean-estimation study (docs/design.md#mean-estimation, #studies): per target ε, the best
RS and LC mean-squared error under PLD and RDP; optionally measured over simulated releases;
and for RS the exact ε of the released mixture beside the mixture bound.

Simulated releases: a synthetic data set (n points of N(0.5, 1), clipped to [−1, 1], so the
sum has sensitivity Δ = 1 and the mean Δ/n for a public n) is released as μ̂ + (Δ/n)·noise;
each LC release draws every candidate's noise independently and combines them with the
calibrated λ, each RS release draws I ~ π and adds candidate I's noise. The measured MSE is
the mean of (release − μ̂)², in units of the squared sensitivity, with its standard error.

Exact RS: for the π the linear programme picks under the mixture bound, the exact ε of the
scalar release (:mod:`dpmerge.studies.rs_exact`, certified upper side); and the best RS MSE
when that exact ε is the constraint (over pairs of candidates: the largest share of the less
noisy one with a certified exact ε ≤ target). It holds for a one-dimensional release: in d
dimensions the noise's norm reveals σ_I, and as d grows the exact ε rises to the mixture bound.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from dpmerge.studies.mean_estimation import (
    MAX_SIGMA,
    MAX_TARGET,
    best_lc_mse,
    best_rs_mse,
    best_rs_weights,
    lc_weights_for_mse,
)
from dpmerge.studies.output import StudyFolder, StudyResult, markdown_table
from dpmerge.studies.plots import figure, log_epsilon_axis
from dpmerge.studies.rs_exact import (
    MixtureAccountant,
    dimension_lower_epsilon,
    mixture_bound_epsilon,
)
from dpmerge.studies.settings import StudyConfigError

STUDY = "mean-estimation"
DATA_POINTS = 1000
_SHARE_STEPS = 30


@dataclass(frozen=True)
class MeanEstimationStudy:
    sigmas: tuple[float, ...]
    targets: tuple[float, ...]
    delta: float
    monte_carlo: int | None = None
    seed: int = 0
    dimensions: tuple[int, ...] = (2, 10, 100)

    def __post_init__(self) -> None:
        if not self.sigmas or any(
            not (math.isfinite(s) and 0 < s <= MAX_SIGMA) for s in self.sigmas
        ):
            raise StudyConfigError(
                f"noise multipliers must lie in (0, {MAX_SIGMA:g}], got {list(self.sigmas)}"
            )
        if not self.targets or any(
            not (math.isfinite(t) and 0 < t <= MAX_TARGET) for t in self.targets
        ):
            raise StudyConfigError(
                f"targets must lie in (0, {MAX_TARGET:g}], got {list(self.targets)}"
            )
        if not 0 < self.delta < 1:
            raise StudyConfigError(f"delta must lie in (0, 1), got {self.delta}")
        if any(d < 2 for d in self.dimensions):
            raise StudyConfigError(f"dimensions must be at least 2, got {list(self.dimensions)}")


def best_rs_exact(
    accountant: MixtureAccountant, sigmas: Sequence[float], target: float, delta: float
) -> tuple[tuple[float, ...], float] | None:
    """The lowest-MSE RS over pairs whose certified exact ε meets ``target``: (π, MSE)."""
    k = len(sigmas)

    def pair(i: int, j: int, share: float) -> tuple[float, ...]:
        return tuple(share if n == i else (1 - share if n == j else 0.0) for n in range(k))

    best: tuple[tuple[float, ...], float] | None = None
    for i, j in itertools.permutations(range(k), 2):
        if sigmas[i] >= sigmas[j] or not accountant.meets(pair(i, j, 0.0), target, delta):
            continue
        low, high = 0.0, 1.0
        if accountant.meets(pair(i, j, 1.0), target, delta):
            low = 1.0
        else:
            for _ in range(_SHARE_STEPS):
                mid = 0.5 * (low + high)
                low, high = (
                    (mid, high) if accountant.meets(pair(i, j, mid), target, delta) else (low, mid)
                )
        pi = pair(i, j, low)
        mse = float(np.dot(pi, np.square(sigmas)))
        if best is None or mse < best[1]:
            best = (pi, mse)
    if best is None:  # pairs need two feasible-or-not candidates; a single one alone:
        alone = [i for i in range(k) if accountant.meets(pair(i, i, 1.0), target, delta)]
        if alone:
            i = min(alone, key=lambda n: sigmas[n])
            best = (pair(i, i, 1.0), float(sigmas[i] ** 2))
    return best


def _measure(
    sigmas: np.ndarray,
    lam: Sequence[float] | None,
    pi: Sequence[float] | None,
    draws: int,
    rng: np.random.Generator,
) -> dict[str, float | None]:
    """Measured MSE (and standard error) of ``draws`` LC and RS releases of a synthetic mean."""
    data = np.clip(rng.normal(0.5, 1.0, DATA_POINTS), -1.0, 1.0)
    sensitivity = 1.0 / DATA_POINTS  # clipped to [−1, 1]: the sum moves by ≤ 1, n is public
    mean = data.mean()
    out: dict[str, float | None] = {}
    for name, releases in (
        (
            "lc",
            None
            if lam is None
            else mean
            + sensitivity * (rng.standard_normal((draws, len(sigmas))) * sigmas) @ np.asarray(lam),
        ),
        (
            "rs",
            None
            if pi is None
            else mean
            + sensitivity
            * sigmas[rng.choice(len(sigmas), size=draws, p=np.asarray(pi) / sum(pi))]
            * rng.standard_normal(draws),
        ),
    ):
        if releases is None:
            out[f"{name}_mse_measured"] = out[f"{name}_mse_measured_se"] = None
            continue
        errors = ((releases - mean) / sensitivity) ** 2
        out[f"{name}_mse_measured"] = float(errors.mean())
        out[f"{name}_mse_measured_se"] = float(errors.std(ddof=1) / math.sqrt(draws))
    return out


def _point(
    study: MeanEstimationStudy, accountant: MixtureAccountant, target: float
) -> dict[str, object]:
    sigmas, delta = study.sigmas, study.delta
    row: dict[str, object] = {
        "target_epsilon": target,
        "lc_mse_pld": best_lc_mse(sigmas, target, delta, "pld"),
        "rs_mse_pld": best_rs_mse(sigmas, target, delta, "pld"),
        "lc_mse_rdp": best_lc_mse(sigmas, target, delta, "rdp"),
        "rs_mse_rdp": best_rs_mse(sigmas, target, delta, "rdp"),
    }
    pi = best_rs_weights(sigmas, target, delta, "pld")
    row["rs_weights_pld"] = None if pi is None else [round(p, 8) for p in pi]
    row["rs_epsilon_mixture_bound"] = (
        None if pi is None else mixture_bound_epsilon(sigmas, pi, delta)
    )
    bracket = None if pi is None else accountant.bracket(pi, delta)
    row["rs_epsilon_exact"] = None if bracket is None else bracket.upper
    row["rs_epsilon_exact_lower"] = None if bracket is None else bracket.lower
    exact = best_rs_exact(accountant, sigmas, target, delta)
    row["rs_mse_exact"] = None if exact is None else exact[1]
    row["rs_weights_exact"] = None if exact is None else [round(p, 8) for p in exact[0]]
    row["rs_epsilon_exact_of_best"] = (
        None if exact is None else accountant.bracket(exact[0], delta).upper
    )
    lc = row["lc_mse_pld"]
    row["lc_le_rs_exact"] = None if exact is None or lc is None else bool(lc <= exact[1] + 1e-12)
    for d in study.dimensions:  # lower bounds on the exact ε of a d-dimensional release
        row[f"rs_epsilon_d{d}_lower"] = (
            None if pi is None else dimension_lower_epsilon(sigmas, pi, delta, d)
        )
        row[f"rs_epsilon_of_best_d{d}_lower"] = (
            None if exact is None else (dimension_lower_epsilon(sigmas, exact[0], delta, d))
        )
    if study.monte_carlo:
        lam = None if lc is None else lc_weights_for_mse(sigmas, float(lc))  # type: ignore[arg-type]
        rng = np.random.default_rng([study.seed, int(target * 1e9)])
        row.update(_measure(np.asarray(sigmas, float), lam, pi, study.monte_carlo, rng))
    return row


def run_mean_estimation_study(study: MeanEstimationStudy, folder: StudyFolder) -> StudyResult:
    accountant = MixtureAccountant(study.sigmas)
    folder.start(len(study.targets), STUDY)
    identity = {k: v for k, v in asdict(study).items() if k != "targets"}
    try:
        rows = [
            folder.cached(
                "point", {**identity, "target": t}, lambda t=t: _point(study, accountant, t)
            )
            for t in study.targets
        ]
    finally:
        folder.close()
    table = pd.DataFrame(rows)
    files = [
        folder.write_table("mean_estimation", table),
        _plot_mse(table, folder.root / "mse_vs_epsilon.png", study),
        _plot_exact(table, folder.root / "rs_exact_vs_bound.png", study),
        folder.write_text("mean_estimation.md", _markdown(table, study)),
    ]
    metrics = [
        (column, float(value), step)
        for step, row in enumerate(rows)
        for column, value in row.items()
        if column != "target_epsilon" and isinstance(value, float)
    ] + [("target_epsilon", float(t), step) for step, t in enumerate(study.targets)]
    feasible = table.dropna(subset=["rs_mse_exact", "lc_mse_pld"])
    summary = {
        "targets": len(rows),
        "lc <= rs (mixture bound, PLD)": int((table.lc_mse_pld <= table.rs_mse_pld + 1e-12).sum()),
        "lc <= rs (exact RS, scalar release)": int(feasible.lc_le_rs_exact.astype(bool).sum()),
    }
    for d in study.dimensions:
        invalid = table[f"rs_epsilon_of_best_d{d}_lower"] > table.target_epsilon
        summary[f"scalar-exact RS choice over its target at d = {d}"] = int(invalid.sum())
    return folder.result(STUDY, files, asdict(study), metrics, summary, rows)


def _markdown(table: pd.DataFrame, study: MeanEstimationStudy) -> str:
    view = table[
        [
            "target_epsilon",
            "lc_mse_pld",
            "rs_mse_pld",
            "rs_mse_exact",
            "lc_mse_rdp",
            "rs_mse_rdp",
            "rs_epsilon_mixture_bound",
            "rs_epsilon_exact",
        ]
    ]
    if "lc_mse_measured" in table:
        view = view.assign(
            lc_mse_measured=table.lc_mse_measured, rs_mse_measured=table.rs_mse_measured
        )
    return "\n".join(
        [
            "# Mean estimation",
            "",
            f"σ = {', '.join(f'{s:g}' for s in study.sigmas)}; δ = {study.delta:g}; MSE per "
            "coordinate in units of the squared sensitivity (no clipping bias). PLD: exact "
            "Gaussian "
            "profile; RS under PLD uses the mixture bound Σπ_i·δ_i(ε). `rs_mse_exact`: best RS "
            "(over pairs) when the exact ε of the scalar release is the constraint; "
            "`rs_epsilon_exact`: exact ε (certified upper side) of the π chosen under the bound, "
            "beside that bound."
            + (
                f" Measured: {study.monte_carlo} simulated releases per point."
                if study.monte_carlo
                else ""
            ),
            "",
            markdown_table(view),
            "",
            "## RS in d dimensions (lower bounds on the exact ε; the mixture bound is the upper)",
            "",
            "The scalar release hides the index I; a d-dimensional one reveals σ_I through the "
            "noise's norm. `bound π`: the π chosen under the mixture bound; `scalar-best π`: the "
            "π of `rs_mse_exact`. A lower bound above the target means that π is not private "
            "enough in d dimensions.",
            "",
            markdown_table(_dimension_view(table, study)),
            "",
        ]
    )


def _dimension_view(table: pd.DataFrame, study: MeanEstimationStudy) -> pd.DataFrame:
    view = {
        "target_epsilon": table.target_epsilon,
        "bound π: mixture bound": table.rs_epsilon_mixture_bound,
        "bound π: d=1 exact": table.rs_epsilon_exact,
    }
    for d in study.dimensions:
        view[f"bound π: d={d} ≥"] = table[f"rs_epsilon_d{d}_lower"]
    view["scalar-best π: d=1 exact"] = table.rs_epsilon_exact_of_best
    for d in study.dimensions:
        view[f"scalar-best π: d={d} ≥"] = table[f"rs_epsilon_of_best_d{d}_lower"]
    return pd.DataFrame(view)


def _plot_mse(table: pd.DataFrame, path, study: MeanEstimationStudy):  # type: ignore[no-untyped-def]
    with figure(path) as (axes,):
        for column, label in (
            ("lc_mse_pld", "LC (PLD, exact Gaussian)"),
            ("rs_mse_pld", "RS (PLD, mixture bound)"),
            ("lc_mse_rdp", "LC (RDP)"),
            ("rs_mse_rdp", "RS (RDP)"),
            ("rs_mse_exact", "RS (exact ε of the scalar release)"),
        ):
            rows = table.dropna(subset=[column])
            axes.plot(rows.target_epsilon, rows[column], marker="o", markersize=3, label=label)
        for name in ("lc", "rs"):
            if f"{name}_mse_measured" in table:
                rows = table.dropna(subset=[f"{name}_mse_measured"])
                axes.errorbar(
                    rows.target_epsilon,
                    rows[f"{name}_mse_measured"],
                    yerr=2 * rows[f"{name}_mse_measured_se"],
                    fmt="x",
                    color="black",
                    label="measured (±2 se)" if name == "lc" else None,
                )
        log_epsilon_axis(axes, f"target ε (δ = {study.delta:g})")
        axes.set_yscale("log")
        axes.set_ylabel("MSE per coordinate / Δ²")
        axes.set_title(f"mean estimation, σ = {', '.join(f'{s:g}' for s in study.sigmas)}")
    return path


def _plot_exact(table: pd.DataFrame, path, study: MeanEstimationStudy):  # type: ignore[no-untyped-def]
    rows = table.dropna(subset=["rs_epsilon_exact"])
    with figure(path) as (axes,):
        axes.plot(
            rows.target_epsilon,
            rows.rs_epsilon_mixture_bound,
            marker="o",
            label="mixture bound Σπδ_i (what RS is calibrated with)",
        )
        axes.plot(
            rows.target_epsilon,
            rows.rs_epsilon_exact,
            marker="o",
            label="exact ε of the same π, scalar release",
        )
        for d in study.dimensions:
            axes.plot(
                rows.target_epsilon,
                rows[f"rs_epsilon_d{d}_lower"],
                marker=".",
                linestyle=":",
                label=f"same π, {d}-dimensional release (lower bound)",
            )
        log_epsilon_axis(axes, "target ε")
        axes.set_yscale("log")
        axes.set_ylabel(f"ε of the chosen RS (δ = {study.delta:g})")
        axes.set_title("RS: mixture bound against the exact mixture")
    return path
