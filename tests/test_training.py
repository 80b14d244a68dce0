"""DP-SGD training and its mechanism record (dpmerge.training, ``dpmerge train``;
docs/design.md#mechanism-record, docs/design.md#accounting-primitives)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import dpmerge.cli
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.artifacts import ModelSpec, load_model_dir
from dpmerge.data import DatasetSplits, RowDataset, Split, load_dataset
from dpmerge.data.datasets import FASHION_MNIST_ROOT
from dpmerge.evaluation import evaluate
from dpmerge.formatting import epsilon_text
from dpmerge.models import build_model, check_weights_match, model_spec
from dpmerge.training import (
    GRAD_SAMPLE_MODES,
    LINEAR_EXACT,
    OPACUS_MODES,
    EpochMetrics,
    RunOptions,
    TrainConfig,
    TrainingConfigError,
    declared_parameters,
    save_candidate,
    train_candidate,
    train_candidates,
    train_kept,
)
from dpmerge.training.checkpoint import RunState
from dpmerge.training.engines.layers import LayerGradients
from dpmerge.training.engines.linear import PoissonSubsetSampler
from dpmerge.training.engines.opacus import OpacusEngine
from dpmerge.training.engines.vmap import PerExampleGradients
from dpmerge.training.plan import MechanismPlan
from dpmerge.training.streams import Streams
from dpmerge.vocabulary import ModelName

DELTA = 1e-5
ENGINES = ("ghost", LINEAR_EXACT)
"""The Opacus engine (its fastest logreg mode) and the linear-exact engine: the tests of what
a run records and how its streams behave hold for both."""
EPSILON_SLACK = 1e-6
"""dpmerge's ε may sit above dp_accounting's by a safety margin, never below."""


@pytest.fixture(scope="module")
def digits() -> DatasetSplits:
    return load_dataset("digits")


def config(**overrides: object) -> TrainConfig:
    settings: dict = dict(
        dataset="digits", model="logreg", noise_multiplier=1.0, batch_size=64, noise_seed=1
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fresh_pld_epsilon(sigma: float, q: float, steps: int) -> float:
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    accountant.compose(dp_event.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("mode", ENGINES)
def test_record_is_what_ran(digits: DatasetSplits, mode: str) -> None:
    result = train_candidate(config(epochs=2, grad_sample_mode=mode), digits)
    record, n = result.record, digits.dataset_size
    loader_length = len(DataLoader(RowDataset(digits.train.features, digits.train.labels), 64))
    assert loader_length == math.ceil(n / 64)
    assert record.sample_rate == 1 / loader_length != 64 / n
    assert result.accountant_history == ((1.0, record.sample_rate, 2 * loader_length),)
    assert record.steps == result.metrics["steps"] == 2 * loader_length
    assert record.expected_batch_size == int(n * record.sample_rate)
    assert (record.noise_multiplier, record.clip_norm, record.learning_rate) == (1.0, 1.0, 2.0)
    assert record.optimizer == "sgd" and record.sampling == "poisson"
    assert (record.dataset, record.dataset_size) == (digits.fingerprint, n)
    assert record.initialisation == "zeros" and record.noise_lineage == "noise-seed-1"
    assert record.batch_lineage.endswith("/batches-fresh")
    assert result.metrics["grad_sample_mode"] == mode


def test_logreg_defaults_to_the_linear_engine(digits: DatasetSplits) -> None:
    assert config().mode == LINEAR_EXACT and config(model="cnn").mode == "layers"
    assert config(model="cnn").model is ModelName.CNN and config(clip_norm=2).clip_norm == 2.0
    assert train_candidate(config(max_steps=2), digits).metrics["grad_sample_mode"] == LINEAR_EXACT


@pytest.mark.parametrize("mode", ENGINES)
def test_record_epsilon_equals_fresh_accountants(digits: DatasetSplits, mode: str) -> None:
    result = train_candidate(config(noise_multiplier=0.9, epochs=2, grad_sample_mode=mode), digits)
    record = result.record
    assert result.accountant_history == ((0.9, record.sample_rate, record.steps),)
    bound = candidate_bound(record, DELTA)
    fresh = fresh_pld_epsilon(record.noise_multiplier, record.sample_rate, record.steps)
    assert fresh <= bound.epsilon_pld <= fresh + EPSILON_SLACK
    opacus_rdp = RDPAccountant()
    opacus_rdp.history = list(result.accountant_history)
    assert bound.epsilon_rdp == pytest.approx(opacus_rdp.get_epsilon(DELTA), rel=0.02)


def test_target_epsilon_is_calibrated_for_the_q_and_steps_that_run(digits: DatasetSplits) -> None:
    result = train_candidate(
        config(noise_multiplier=None, target_epsilon=3.0, epochs=2, max_steps=30), digits
    )
    record = result.record
    assert record.steps == 30 and record.sample_rate == 1 / math.ceil(digits.dataset_size / 64)
    # σ is calibrated to within 0.1 %: calibrating for the 2 planned epochs (42 steps) would
    # leave ε at 30 steps far below the target
    epsilon = candidate_bound(record, DELTA).epsilon_pld
    assert 3.0 * 0.99 <= epsilon <= 3.0


def test_max_steps_stops_early_and_the_record_counts_the_steps_run(digits: DatasetSplits) -> None:
    result = train_candidate(config(epochs=3, max_steps=7), digits)
    assert result.record.steps == 7 and sum(t for *_, t in result.accountant_history) == 7
    fresh = fresh_pld_epsilon(1.0, result.record.sample_rate, 7)
    assert fresh <= candidate_bound(result.record, DELTA).epsilon_pld <= fresh + EPSILON_SLACK


def record_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, ...]]]:
    """Patch both engines' batch sources to log the rows of every batch; one list per run."""
    runs: list[list[tuple[int, ...]]] = []
    original_getitems, original_sample = RowDataset.__getitems__, PoissonSubsetSampler.sample

    def logged_getitems(self: RowDataset, indices: list[int]) -> list:
        runs[-1].append(tuple(indices))
        return original_getitems(self, indices)

    def logged_sample(self: PoissonSubsetSampler) -> np.ndarray:
        rows = original_sample(self)
        runs[-1].append(tuple(rows.tolist()))
        return rows

    monkeypatch.setattr(RowDataset, "__getitems__", logged_getitems)
    monkeypatch.setattr(PoissonSubsetSampler, "sample", logged_sample)
    return runs


@pytest.mark.parametrize("mode", ENGINES)
def test_shared_batch_seed_draws_identical_batches(
    digits: DatasetSplits, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    runs = record_batches(monkeypatch)
    settings = [
        dict(batch_seed=7, noise_seed=1),
        dict(batch_seed=7, noise_seed=2),
        dict(batch_seed=8, noise_seed=1),
        dict(batch_seed=None),
        dict(batch_seed=None),
        dict(batch_seed=7, batch_size=32),
    ]
    records = []
    for overrides in settings:
        runs.append([])
        records.append(
            train_candidate(config(epochs=2, grad_sample_mode=mode, **overrides), digits).record
        )
    assert runs[0] == runs[1] and len(runs[0]) == records[0].steps
    assert runs[0] != runs[2] and runs[3] != runs[4] and runs[0] != runs[5]
    lineages = [r.batch_lineage for r in records]
    assert lineages[0] == lineages[1]
    assert len({lineages[0], *lineages[2:]}) == 5  # other seed, fresh, fresh, other q
    assert records[0].noise_lineage == records[2].noise_lineage != records[1].noise_lineage
    assert records[3].noise_lineage == records[4].noise_lineage == "noise-seed-1"


def test_fresh_noise_seed_gives_a_fresh_lineage(digits: DatasetSplits) -> None:
    a, b = (train_candidate(config(noise_seed=None, max_steps=3), digits) for _ in range(2))
    assert a.record.noise_lineage != b.record.noise_lineage
    assert a.record.noise_lineage.endswith("/noise-fresh")
    assert not weights_equal(a.weights, b.weights)


@pytest.mark.parametrize(("mode", "accounted_rate"), [("ghost", 1 / 92), (LINEAR_EXACT, 1 / 93)])
def test_same_seeds_reproduce_and_resume_continues_both_streams(
    digits: DatasetSplits, tmp_path: Path, mode: str, accounted_rate: float
) -> None:
    # batch size 14: q = 1/93 but Opacus' loader pass is int(1/q) = 92 steps long, so the run
    # crosses pass boundaries at steps 92 and 184; it is interrupted mid-pass and on a boundary.
    # Opacus' accountant logs its pessimistic 1/92, the linear engine its sampler's q.
    base = config(batch_size=14, epochs=2, batch_seed=3, grad_sample_mode=mode)
    whole = train_candidate(base, digits)
    assert whole.record.steps == 186 and whole.record.sample_rate == 1 / 93
    assert whole.accountant_history == ((1.0, accounted_rate, 186),)
    assert weights_equal(whole.weights, train_candidate(base, digits).weights)

    checkpoint = tmp_path / "run.pt"
    resumable = replace(base, checkpoint_path=str(checkpoint), checkpoint_every=20)
    first = train_candidate(replace(resumable, max_steps=50), digits)
    assert first.record.steps == 50 and checkpoint.exists()
    second = train_candidate(replace(resumable, max_steps=92), digits)
    assert second.record.steps == 92
    resumed = train_candidate(resumable, digits)
    assert weights_equal(resumed.weights, whole.weights)
    assert resumed.accountant_history == whole.accountant_history
    # A resumed run keeps its run id (its checkpoints are one run); another run has its own.
    assert resumed.record.run_id == first.record.run_id != whole.record.run_id
    assert resumed.record == whole.record.model_copy(
        update={"name": resumed.record.name, "run_id": resumed.record.run_id}
    )
    assert resumed.record.name == first.record.name  # one run, one id
    assert [entry.step for entry in first.history] == [50]  # a partial first epoch
    assert [entry.step for entry in second.history] == [92]
    assert without_clock(resumed.history) == without_clock(whole.history)
    assert [entry.step for entry in whole.history] == [93, 186]

    with pytest.raises(TrainingConfigError, match="differs in noise_multiplier"):
        train_candidate(replace(resumable, noise_multiplier=2.0), digits)
    other_engine = "hooks" if mode == LINEAR_EXACT else LINEAR_EXACT
    with pytest.raises(TrainingConfigError, match="differs in engine"):
        train_candidate(replace(resumable, grad_sample_mode=other_engine), digits)
    with pytest.raises(TrainingConfigError, match="past this run's 10 steps"):
        train_candidate(replace(resumable, max_steps=10), digits)


def test_kept_checkpoints_are_one_run_kept_at_each_epoch(
    digits: DatasetSplits, tmp_path: Path
) -> None:
    """``train_kept``: the run an uninterrupted one would be, kept at the end of each kept
    epoch under one run id; a target ε sets σ once for the whole run, so the last kept epoch
    spends it and earlier ones spend less; the training checkpoint (secret generator states)
    is gone afterwards."""
    base = config(name="run", epochs=3, batch_seed=3)
    whole = train_candidate(base, digits)
    resume = tmp_path / "state.pt"
    kept = list(train_kept(base, digits, [3, 2], resume))
    assert [r.record.name for r in kept] == ["run-e2", "run-e3"]
    assert [r.record.steps for r in kept] == [2 * 21, 3 * 21]  # ⌈1294 / 64⌉ steps an epoch
    assert len({r.record.run_id for r in kept}) == 1 and not resume.exists()
    assert weights_equal(kept[-1].weights, whole.weights)
    assert not weights_equal(kept[0].weights, whole.weights)

    targeted = replace(base, noise_multiplier=None, target_epsilon=2.0)
    first, last = train_kept(targeted, digits, [1, 3], resume)
    assert first.record.noise_multiplier == last.record.noise_multiplier
    spent = [candidate_bound(r.record, DELTA).epsilon_pld for r in (first, last)]
    assert spent[0] < spent[1] <= 2.0 + EPSILON_SLACK and spent[1] > 1.99

    for bad in ([], [0, 1], [4]):
        with pytest.raises(TrainingConfigError, match=r"epochs to keep must lie in 1\.\.3"):
            list(train_kept(base, digits, bad, resume))
    with pytest.raises(TrainingConfigError, match="give neither max_steps"):
        list(train_kept(replace(base, max_steps=5), digits, [1], resume))


def without_clock(history: tuple[EpochMetrics, ...]) -> list[EpochMetrics]:
    return [replace(entry, train_seconds=0.0) for entry in history]


@pytest.mark.parametrize("mode", ENGINES)
def test_history_has_one_entry_per_epoch_and_a_partial_last(
    digits: DatasetSplits, mode: str, tmp_path: Path
) -> None:
    result = train_candidate(config(epochs=3, max_steps=50, grad_sample_mode=mode), digits)
    history = result.history
    assert [(e.epoch, e.step) for e in history] == [(1, 21), (2, 42), (3, 50)]
    assert all(e.train_loss is not None and math.isfinite(e.train_loss) for e in history)
    assert history[0].train_loss > history[-1].train_loss  # it learns
    seconds = [e.train_seconds for e in history]
    assert 0 < seconds[0] <= seconds[1] <= seconds[2] == result.train_seconds
    final = history[-1]
    for split in ("validation", "test"):
        scores = evaluate(result.model, getattr(digits, split))
        assert result.metrics[f"{split}_accuracy"] == getattr(final, f"{split}_accuracy")
        assert getattr(final, f"{split}_accuracy") == scores["accuracy"]
        assert getattr(final, f"{split}_loss") == pytest.approx(scores["loss"], rel=1e-12)
    assert history[0].validation_accuracy != final.validation_accuracy
    saved = load_model_dir(save_candidate(result, tmp_path / "cand", DELTA)).metrics["history"]
    assert [entry["step"] for entry in saved] == [21, 42, 50]
    assert all("train_loss" not in entry for entry in saved)  # no training-set statistic


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_scoring_between_epochs_leaves_the_training_unchanged(
    digits: DatasetSplits, mode: str
) -> None:
    settings = config(grad_sample_mode=mode, batch_size=128, batch_seed=2, epochs=3, max_steps=25)
    empty = Split(digits.test.features[:0], digits.test.labels[:0])
    unscored = train_candidate(settings, replace(digits, validation=empty, test=empty))
    scored = train_candidate(settings, digits)
    assert weights_equal(scored.weights, unscored.weights)
    assert [e.train_loss for e in scored.history] == [e.train_loss for e in unscored.history]
    assert len(scored.history) == 3 and unscored.history[-1].test_accuracy is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("model", "mode"), [("logreg", LINEAR_EXACT), ("cnn", "hooks")])
def test_cuda_run_records_what_ran_scores_each_epoch_and_resumes(
    digits: DatasetSplits, tmp_path: Path, model: str, mode: str
) -> None:
    settings = config(
        model=model, grad_sample_mode=mode, device="auto", batch_size=14, epochs=2, batch_seed=3
    )
    whole = train_candidate(settings, digits)
    assert {p.device.type for p in whole.model.parameters()} == {"cuda"}
    on_cpu = train_candidate(replace(settings, device="cpu"), digits)
    assert whole.record == on_cpu.record.model_copy(
        update={"name": whole.record.name, "run_id": whole.record.run_id}
    )
    assert [e.step for e in whole.history] == [93, 186] and whole.record.steps == 186
    assert all(0 <= e.test_accuracy <= 1 and math.isfinite(e.train_loss) for e in whole.history)
    # a resumed run continues the same streams (kernels need not be bitwise deterministic)
    resumable = replace(settings, checkpoint_path=str(tmp_path / "run.pt"), checkpoint_every=20)
    assert train_candidate(replace(resumable, max_steps=50), digits).record.steps == 50
    resumed = train_candidate(resumable, digits)
    assert resumed.accountant_history == whole.accountant_history
    for key, value in whole.weights.items():
        torch.testing.assert_close(resumed.weights[key], value, atol=1e-4, rtol=1e-4)
    assert [e.step for e in resumed.history] == [93, 186]


@pytest.mark.parametrize("model", ["logreg", "cnn"])
def test_grad_sample_modes_agree(digits: DatasetSplits, model: str) -> None:
    results = [
        train_candidate(config(model=model, batch_seed=1, max_steps=5, grad_sample_mode=m), digits)
        for m in OPACUS_MODES
    ]
    first = results[0]
    for other in results[1:]:
        for key, value in first.weights.items():
            torch.testing.assert_close(other.weights[key], value, atol=1e-5, rtol=1e-4)
        # The mechanism (σ, q, T, C, Poisson batches, accountant) is the same whatever computes
        # the per-example gradients: the records differ only in their run's identity.
        assert other.accountant_history == first.accountant_history
        assert other.record == first.record.model_copy(
            update={"name": other.record.name, "run_id": other.record.run_id}
        )


@pytest.mark.parametrize("mode", OPACUS_MODES)
def test_clipped_sum_equals_a_per_example_loop(mode: str) -> None:
    """With q = 1 (the one Poisson batch holds every row) and σ = 0, a step moves the weights by
    lr·Σ_b clip(g_b)/n, so each mode's clipped sum is read off the step and compared with a loop
    of single-example backward passes, clipped by Opacus' factor min(1, C/(‖g_b‖ + 1e-6))."""
    generator = torch.Generator().manual_seed(0)
    rows = Split(torch.randn(6, 1, 8, 8, generator=generator), torch.tensor([0, 1, 2, 0, 1, 2]))
    spec = ModelSpec("cnn", (1, 8, 8), 3)
    reference = build_model(spec, seed=3)
    loss = torch.nn.CrossEntropyLoss()
    per_example = []
    for x, y in zip(rows.features, rows.labels, strict=True):
        reference.zero_grad()
        loss(reference(x[None]), y[None]).backward()
        per_example.append({k: p.grad.clone() for k, p in reference.named_parameters()})
    norms = torch.stack([torch.cat([g.flatten() for g in e.values()]).norm() for e in per_example])
    clip = norms.median().item()  # some examples clipped, some not
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any() and (factors == 1).any()
    expected = {
        k: sum(f * e[k] for f, e in zip(factors, per_example, strict=True)) for k in per_example[0]
    }

    settings = config(
        model="cnn", grad_sample_mode=mode, batch_size=6, clip_norm=clip, learning_rate=0.5
    )
    engine = OpacusEngine(settings, MechanismPlan(1.0, 1, 1, 0.0), torch.device("cpu"))
    model = build_model(spec, seed=3)
    engine.start(
        model, rows, RunState("run", "noise", "batches"), Streams("run", "noise", "batches", 1, 1)
    )
    engine.step()
    clipped_sum = {
        k: (reference.state_dict()[k] - v) * 6 / 0.5 for k, v in model.state_dict().items()
    }
    for key, value in expected.items():
        torch.testing.assert_close(clipped_sum[key], value, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("gradients", [PerExampleGradients, LayerGradients])
def test_vmap_and_layers_take_an_empty_poisson_batch(gradients: type) -> None:
    """An empty Poisson batch is still a step: ``vmap`` and ``layers`` give empty per-example
    gradients (the loss of one example cannot be taken on none), so Opacus adds only the noise
    (none at σ = 0)."""
    model = build_model(ModelSpec("cnn", (1, 8, 8), 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    loss = gradients(model, torch.nn.CrossEntropyLoss()).compute(
        torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)
    )
    assert loss.isnan()
    assert all(p.grad_sample.shape == (0, *p.shape) for p in model.parameters())
    optimizer.step()
    assert weights_equal(model.state_dict(), before)


def _vector_group_norm() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(64, 12),
            torch.nn.GroupNorm(3, 12),
            torch.nn.Linear(12, 3),
        )


def _assert_same_gradients(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Two float32 computations of one gradient sum the same products in different orders, so
    they differ by rounding that grows with the largest entry (2e-5 at entries near 10 over 300
    random initialisations); a wrong gradient differs by the order of the entries themselves."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [lambda: build_model(ModelSpec("cnn", (1, 8, 8), 3), seed=5), _vector_group_norm],
    ids=["cnn", "group-norm-on-vectors"],
)
def test_layers_per_example_gradients_equal_vmaps(make) -> None:
    """Each example's gradient from ``layers`` (the batch as a convolution's groups and as a
    group norm's channels) equals ``vmap``'s, parameter by parameter."""
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(33, 1, 8, 8, generator=generator), torch.arange(33) % 3
    model, loss = make(), torch.nn.CrossEntropyLoss()
    PerExampleGradients(model, loss).compute(x, y)
    expected = {name: p.grad_sample for name, p in model.named_parameters()}
    LayerGradients(model, loss).compute(x, y)
    for name, p in model.named_parameters():
        assert p.grad_sample.shape == (33, *p.shape)
        _assert_same_gradients(p.grad_sample, expected[name])


def test_layers_writes_a_linear_layers_gradients_into_the_same_memory_and_stays_exact() -> None:
    """Each step's per-example weight gradients of a ``Linear`` layer on vectors go into one
    buffer (fresh memory each step cost page faults, docs/results.md §6.2), grown for a larger
    Poisson batch; every step's gradients still equal ``vmap``'s."""
    model, loss = _vector_group_norm(), torch.nn.CrossEntropyLoss()
    layers, reference = LayerGradients(model, loss), PerExampleGradients(model, loss)
    generator, where = torch.Generator().manual_seed(6), []
    for n in (8, 9, 5, 12):
        x, y = torch.randn(n, 1, 8, 8, generator=generator), torch.arange(n) % 3
        reference.compute(x, y)
        expected = {name: p.grad_sample for name, p in model.named_parameters()}
        layers.compute(x, y)
        for name, p in model.named_parameters():
            _assert_same_gradients(p.grad_sample, expected[name])
        where.append(model[1].weight.grad_sample.data_ptr())
    assert where[0] == where[1] == where[2] != where[3]  # 9 rows fit beside 8; 12 do not


def test_layers_group_norm_gradients_with_saved_or_recomputed_moments_equal_a_loop() -> None:
    """A group norm's per-example affine gradients are the same whether its moments come from
    the forward pass (autograd's saved ones) or are computed again, and equal a loop of
    single-example backward passes."""
    from dpmerge.training.engines.layers import _per_example

    generator = torch.Generator().manual_seed(4)
    norm = torch.nn.GroupNorm(2, 6)
    torch.nn.init.normal_(norm.weight, generator=generator)
    a = torch.randn(5, 6, 3, 4, generator=generator) * 3 + 1
    g = torch.randn(5, 6, 3, 4, generator=generator)
    out = norm(a.requires_grad_())
    saved = (out.grad_fn._saved_result1, out.grad_fn._saved_result2)
    _per_example(norm, a.detach(), g, saved)
    from_forward = norm.weight.grad_sample, norm.bias.grad_sample
    _per_example(norm, a.detach(), g)
    recomputed = norm.weight.grad_sample, norm.bias.grad_sample
    for b in range(5):
        norm.zero_grad()
        norm(a[b : b + 1].detach()).backward(g[b : b + 1])
        for got in (from_forward, recomputed):
            torch.testing.assert_close(got[0][b], norm.weight.grad, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[1][b], norm.bias.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("model", "refused"),
    [
        (torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Bilinear(2, 2, 3)), "Linear, Conv2d"),
        (torch.nn.Conv2d(2, 2, 3, groups=2), "groups 1"),
        (torch.nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "zero padding"),
    ],
)
def test_layers_refuses_what_it_has_no_closed_form_for(
    model: torch.nn.Module, refused: str
) -> None:
    with pytest.raises(TrainingConfigError, match=refused):
        LayerGradients(model, torch.nn.CrossEntropyLoss())


def test_layers_refuses_a_layer_called_twice() -> None:
    linear = torch.nn.Linear(3, 3)
    gradients = LayerGradients(torch.nn.Sequential(linear, linear), torch.nn.CrossEntropyLoss())
    with pytest.raises(TrainingConfigError, match="once"):
        gradients.compute(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


def test_initial_checkpoint_is_recorded_by_hash(digits: DatasetSplits, tmp_path: Path) -> None:
    path = tmp_path / "public.safetensors"
    save_file(build_model(model_spec("cnn", digits), seed=11).state_dict(), str(path))
    result = train_candidate(config(model="cnn", max_steps=2, init_checkpoint=str(path)), digits)
    assert result.record.initialisation.startswith("checkpoint:")
    assert len(result.record.initialisation) == len("checkpoint:") + 64


def test_saved_candidate_round_trips(digits: DatasetSplits, tmp_path: Path) -> None:
    first, second = train_candidates(
        [config(model="cnn", max_steps=5), config(model="cnn", max_steps=5, noise_seed=2)], digits
    )
    assert not weights_equal(first.weights, second.weights)
    out = save_candidate(first, tmp_path / "cand", DELTA)
    loaded = load_model_dir(out)
    assert loaded.record == first.record and loaded.spec == first.spec
    assert (
        loaded.candidate_privacy["epsilon_pld"] == candidate_bound(first.record, DELTA).epsilon_pld
    )
    assert loaded.candidate_privacy["delta"] == DELTA
    assert {"validation_accuracy", "test_accuracy", "test_loss"} <= loaded.metrics.keys()
    check_weights_match(loaded.spec, loaded.weights)
    model = build_model(loaded.spec)
    model.load_state_dict(loaded.weights)
    x = digits.test.features[:16]
    torch.testing.assert_close(model.eval()(x), first.model.eval()(x))


@pytest.mark.skipif(not Path(FASHION_MNIST_ROOT).is_dir(), reason="no Fashion-MNIST")
def test_fashion_mnist_rows_train_and_record() -> None:
    data = load_dataset("fashion-mnist", limit=400)
    result = train_candidate(
        TrainConfig("fashion-mnist", "cnn", noise_multiplier=1.0, batch_size=32, noise_seed=0),
        data,
    )
    assert result.record.dataset_size == 360 and result.record.sample_rate == 1 / 12
    assert result.record.steps == 12 and result.record.dataset == data.fingerprint
    assert 0 <= result.metrics["test_accuracy"] <= 1


def test_bad_configurations_are_refused(digits: DatasetSplits) -> None:
    with pytest.raises(TrainingConfigError, match="exactly one of"):
        config(target_epsilon=2.0)
    with pytest.raises(TrainingConfigError, match="exactly one of"):
        config(noise_multiplier=None)
    with pytest.raises(TrainingConfigError, match="batch_size must be a positive"):
        config(batch_size=0)
    with pytest.raises(TrainingConfigError, match="unknown model 'mlp'; known: logreg, cnn"):
        config(model="mlp")
    with pytest.raises(TrainingConfigError, match="epochs must be an integer, got True"):
        config(epochs=True)
    with pytest.raises(TrainingConfigError, match="clip_norm must be a number, got '1'"):
        config(clip_norm="1")
    with pytest.raises(TrainingConfigError, match="torch_threads must be a positive number"):
        RunOptions(torch_threads=0)
    with pytest.raises(TrainingConfigError, match="grad_sample_mode"):
        config(grad_sample_mode="fast")
    with pytest.raises(TrainingConfigError, match="runs only logreg, not 'cnn'"):
        config(model="cnn", grad_sample_mode=LINEAR_EXACT)
    with pytest.raises(TrainingConfigError, match="data is 'digits'"):
        train_candidate(config(dataset="mnist"), digits)
    if not torch.cuda.is_available():
        with pytest.raises(TrainingConfigError, match="CUDA is not available"):
            train_candidate(config(device="cuda"), digits)


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    return dpmerge.cli.main(["train", *args])


def test_cli_trains_and_writes_the_model_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cand"
    code = run_cli(
        monkeypatch,
        *("--dataset", "digits", "--model", "logreg", "--target-epsilon", "4"),
        *("--delta", "1e-6", "--epochs", "1", "--batch-size", "128", "--seed", "1"),
        *("--noise-seed", "5", "--batch-seed", "6", "--out", str(out), "--no-progress"),
        "--json",
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    document = json.loads((out / "record.json").read_text())
    assert document["privacy"]["delta"] == 1e-6
    assert document["privacy"]["epsilon_pld"] == summary["epsilon_pld"] <= 4.0
    assert document["privacy"]["epsilon_rdp"] == summary["epsilon_rdp"]
    assert document["record"]["noise_lineage"] == "noise-seed-5"
    assert (out / "weights.safetensors").is_file()
    assert json.loads((out / "metrics.json").read_text())["steps"] == summary["steps"] == 11


def test_cli_prints_the_privacy_it_spent_and_checks_delta_against_n(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary names σ, q, T, n, ε under both accountants at δ and the accuracies; δ is
    refused at 1/n or more (nothing written) and warned about above 1/(10·n)."""
    common = ("--dataset", "digits", "--model", "logreg", "--noise-multiplier", "2")
    common += ("--epochs", "1", "--batch-size", "128", "--no-progress")
    n = load_dataset("digits").dataset_size
    refused = tmp_path / "refused"
    assert dpmerge.cli.main(["train", *common, "--delta", f"{1 / n}", "--out", str(refused)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is not below 1/n = {1 / n:.3g} for n = {n:,}" in err
    assert not refused.exists()
    out = tmp_path / "cand"
    delta = 1 / (5 * n)  # below 1/n, above 1/(10·n)
    assert dpmerge.cli.main(["train", *common, "--delta", f"{delta}", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.err.startswith(f"dpmerge: warning: δ = {delta:g} is above 1/(10·n)")
    privacy = json.loads((out / "record.json").read_text())["privacy"]
    lines = printed.out.splitlines()
    assert lines[0].startswith("trained ") and lines[0].endswith(f" → {out}")
    assert f"over n = {n:,} rows" in lines[1] and "σ = 2" in lines[1]
    assert lines[2] == (
        f"  ε = {epsilon_text(privacy['epsilon_pld'])} (PLD), "
        f"{epsilon_text(privacy['epsilon_rdp'])} (RDP) at δ = {delta:g}, add-or-remove-one"
    )
    assert lines[3].startswith("  validation accuracy 0.") and "test accuracy 0." in lines[3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--dataset", "fashion-mnist", "--data-root", "/nonexistent"), "dataset-fashion-mnist"),
        (("--dataset", "digits", "--threads", "0"), "torch_threads must be a positive"),
        (("--dataset", "digits", "--target-epsilon", "2"), "exactly one of"),
        (("--dataset", "digits", "--noise-multiplier", "-1"), "noise_multiplier must be"),
        (("--dataset", "digits", "--out", "EXISTING"), "already exists"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: tuple[str, ...],
    message: str,
) -> None:
    (tmp_path / "EXISTING").mkdir()
    defaults = {"--model": "logreg", "--noise-multiplier": "1", "--out": "new"}
    given = dict(zip(args[::2], args[1::2], strict=True))
    merged = {**defaults, **given}
    argv = [part for key, value in merged.items() for part in (key, value)]
    argv = [str(tmp_path / a) if a in ("new", "EXISTING") else a for a in argv]
    before = sorted(tmp_path.rglob("*"))
    code = run_cli(monkeypatch, *argv, "--checkpoint", str(tmp_path / "ck.pt"), "--no-progress")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == dpmerge.cli.EXIT_BAD_INPUT
    assert len(err) == 1 and err[0].startswith("dpmerge: error:") and message in err[0]
    assert sorted(tmp_path.rglob("*")) == before


def test_cli_options_are_the_declared_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = dpmerge.cli.build_parser(command="train")
    (train,) = parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
    options = {action.dest: action for action in train._actions}
    declared = [*declared_parameters(TrainConfig), *declared_parameters(RunOptions)]
    assert set(options) == {"help", "out", "json"} | {p.name for p in declared}
    for parameter in declared:
        assert options[parameter.name].help.endswith(parameter.help)
        assert options[parameter.name].choices == parameter.choices
    assert options["model"].choices is None  # a built-in name or module:callable
    assert "--lr" in options["learning_rate"].option_strings
    assert "--no-progress" in options["progress"].option_strings
    # a word outside a vocabulary is refused before anything is read or written
    out = tmp_path / "new"
    with pytest.raises(SystemExit) as exit_info:
        dpmerge.cli.main(["train", "--dataset", "mnst", "--model", "cnn", "--out", str(out)])
    assert exit_info.value.code == dpmerge.cli.EXIT_BAD_INPUT
    assert "invalid choice: 'mnst'" in capsys.readouterr().err and not out.exists()
    code = dpmerge.cli.main(["train", "--dataset", "digits", "--model", "cnm", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == dpmerge.cli.EXIT_BAD_INPUT and err.count("\n") == 1 and not out.exists()
    assert (
        "unknown model 'cnm'; known: logreg, cnn, resnet18_gn, transformers, or module:callable"
        in err
    )
    assert "did you mean 'cnn'?" in err
