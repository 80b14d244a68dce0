"""The linear-exact DP-SGD engine implements the mechanism Opacus runs
(dpmerge.training.engines.linear, docs/design.md#mechanism-record): Poisson sampling, per-example
clipping, Gaussian
noise, plain SGD, same record."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from scipy import stats
from torch import nn
from torch.func import functional_call, grad, vmap

from dpmerge.data import DatasetSplits, RowDataset, load_dataset
from dpmerge.training import LINEAR_EXACT, TrainConfig, train_candidate
from dpmerge.training.engines.linear import (
    SAMPLER_ID,
    LinearDPSGD,
    PoissonSubsetSampler,
    clipped_gradient_sum,
)


@pytest.fixture(scope="module")
def digits() -> DatasetSplits:
    return load_dataset("digits")


def config(**overrides: object) -> TrainConfig:
    settings: dict = dict(
        dataset="digits", model="logreg", noise_multiplier=1.0, batch_size=64, noise_seed=1
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def random_layer(features: int, classes: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(features, classes)
    nn.init.normal_(layer.weight, std=0.5)
    return layer


def engine(
    layer: nn.Linear, x: torch.Tensor, y: torch.Tensor, *, q: float, seed: int = 0, **settings
) -> LinearDPSGD:
    options: dict = dict(noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.5)
    options.update(settings)
    return LinearDPSGD(
        layer,
        x,
        y,
        noise_generator=torch.Generator().manual_seed(seed),
        sampler=PoissonSubsetSampler(len(y), q).manual_seed(seed),
        **options,
    )


def test_clipped_sum_equals_opacus_per_example_clipping() -> None:
    torch.manual_seed(1)
    x = torch.randn(50, 20) * torch.rand(50, 1) * 3
    y = torch.randint(0, 5, (50,))
    layer = random_layer(20, 5)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        logits = functional_call(layer, p, (xb[None],))
        return nn.functional.cross_entropy(logits, yb[None], reduction="sum")

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.cat([g.flatten(1) for g in per_example.values()], 1).norm(dim=1)
    clip = float(norms.median())  # half the examples are clipped, half are not
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    reference = {k: torch.einsum("b,b...->...", factor, g) for k, g in per_example.items()}

    weight_sum, bias_sum, losses = clipped_gradient_sum(layer.weight, layer.bias, x, y, clip)
    torch.testing.assert_close(weight_sum, reference["weight"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias_sum, reference["bias"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses, nn.functional.cross_entropy(layer(x), y, reduction="none"))

    # and Opacus' own optimizer, from its hooks' per-sample gradients
    module = GradSampleModule(copy.deepcopy(layer), loss_reduction="sum")
    optimizer = DPOptimizer(
        torch.optim.SGD(module.parameters(), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=50,
        loss_reduction="sum",
    )
    nn.functional.cross_entropy(module(x), y, reduction="sum").backward()
    optimizer.clip_and_accumulate()
    weight, bias = module._module.weight, module._module.bias
    torch.testing.assert_close(weight_sum, weight.summed_grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias_sum, bias.summed_grad, atol=1e-5, rtol=1e-5)


def test_noiseless_unclipped_step_is_plain_sgd_on_the_summed_loss() -> None:
    torch.manual_seed(2)
    x, y = torch.randn(200, 12), torch.randint(0, 4, (200,))
    layer = random_layer(12, 4)
    reference = copy.deepcopy(layer)
    dp = engine(layer, x, y, q=0.1, seed=3, noise_multiplier=0.0, clip_norm=1e9)
    rows = torch.from_numpy(PoissonSubsetSampler(200, 0.1).manual_seed(3).sample())
    assert dp.expected_batch_size == 20 and 0 < len(rows) != 20
    dp.step()

    loss = nn.functional.cross_entropy(reference(x[rows]), y[rows], reduction="sum") / 20
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    torch.testing.assert_close(layer.weight, reference.weight, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.bias, reference.bias, atol=1e-6, rtol=1e-6)


def test_sampler_is_poisson() -> None:
    n, q, draws = 40, 0.1, 20_000
    sampler = PoissonSubsetSampler(n, q).manual_seed(11)
    included = np.zeros((draws, n), dtype=bool)
    for draw in range(draws):
        rows = sampler.sample()
        assert np.all(np.diff(rows) > 0) and (len(rows) == 0 or 0 <= rows[0] <= rows[-1] < n)
        included[draw, rows] = True

    # each row independently with probability q: inclusion and co-inclusion frequencies
    tolerance = 5 * math.sqrt(q * (1 - q) / draws)
    assert np.abs(included.mean(0) - q).max() < tolerance
    together = (included.T.astype(float) @ included) / draws
    pairs = together[np.triu_indices(n, 1)]
    assert np.abs(pairs - q * q).max() < 5 * math.sqrt(q * q * (1 - q * q) / draws)

    # batch sizes are Binomial(n, q), empty batches included (chi-square, tail bins pooled)
    sizes = np.bincount(included.sum(1), minlength=n + 1)
    expected = stats.binom.pmf(np.arange(n + 1), n, q) * draws
    assert sizes[0] > 0
    last = int(np.nonzero(expected >= 5)[0].max())
    observed = np.append(sizes[:last], sizes[last:].sum())
    expected = np.append(expected[:last], expected[last:].sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_sampler_stream_is_seeded_and_resumable() -> None:
    def stream(sampler: PoissonSubsetSampler, count: int) -> list[list[int]]:
        return [sampler.sample().tolist() for _ in range(count)]

    first = PoissonSubsetSampler(1000, 0.05).manual_seed(4)
    head = stream(first, 3)
    state = first.get_state()
    tail = stream(first, 3)
    assert stream(PoissonSubsetSampler(1000, 0.05).manual_seed(4), 6) == head + tail
    assert stream(PoissonSubsetSampler(1000, 0.05).manual_seed(5), 3) != head
    resumed = PoissonSubsetSampler(1000, 0.05)
    resumed.set_state(state)
    assert stream(resumed, 3) == tail


def test_noise_is_gaussian_with_std_sigma_c_even_on_empty_batches() -> None:
    # zero features: the weight's data gradient is exactly 0, so its update is pure noise
    n, sigma, clip, lr, steps = 300, 4.0, 0.5, 0.1, 20
    x, y = torch.zeros(n, 16), torch.randint(0, 10, (n,))
    layer = nn.Linear(16, 10)
    dp = engine(layer, x, y, q=0.2, noise_multiplier=sigma, clip_norm=clip, learning_rate=lr)
    noise = []
    for _ in range(steps):
        before = layer.weight.detach().clone()
        dp.step()
        noise.append((before - layer.weight.detach()) * dp.expected_batch_size / lr)
    noise = torch.cat(noise).flatten().double()
    assert abs(float(noise.mean())) < 4 * sigma * clip / math.sqrt(len(noise))
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.03)
    assert stats.kstest(noise.numpy() / (sigma * clip), "norm").pvalue > 1e-3

    # an empty batch is still a noisy step, on the bias too, and is accounted
    x, y = torch.randn(100, 16), torch.randint(0, 10, (100,))
    layer = nn.Linear(16, 10)
    dp = engine(layer, x, y, q=0.01, noise_multiplier=sigma, clip_norm=clip)
    dp.sampler.sample = lambda: np.zeros(0, dtype=np.int64)  # type: ignore[method-assign]
    before = [p.detach().clone() for p in layer.parameters()]
    assert math.isnan(dp.step())
    assert all(not torch.equal(b, p) for b, p in zip(before, layer.parameters(), strict=True))
    assert dp.accountant.history == [(sigma, 0.01, 1)]


def test_same_batches_and_noise_seed_reproduce_the_opacus_run(
    digits: DatasetSplits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replaying Opacus' batches, the linear engine draws the same noise from the same noise
    lineage and lands on the same weights: the same mechanism, step by step."""
    batches: list[np.ndarray] = []
    getitems = RowDataset.__getitems__

    def logged(self: RowDataset, indices: list[int]) -> list:
        batches.append(np.asarray(indices, dtype=np.int64))
        return getitems(self, indices)

    monkeypatch.setattr(RowDataset, "__getitems__", logged)
    settings = dict(batch_size=32, max_steps=40, noise_seed=3, noise_multiplier=0.7, clip_norm=0.3)
    opacus = train_candidate(config(grad_sample_mode="ghost", **settings), digits)
    assert len(batches) == 40
    replay = iter(batches)
    monkeypatch.setattr(PoissonSubsetSampler, "sample", lambda self: next(replay))
    linear = train_candidate(config(grad_sample_mode=LINEAR_EXACT, **settings), digits)
    for key, value in opacus.weights.items():
        torch.testing.assert_close(linear.weights[key], value, atol=1e-5, rtol=1e-5)


def test_record_equals_the_opacus_record(digits: DatasetSplits) -> None:
    settings = dict(
        noise_multiplier=None, target_epsilon=2.0, epochs=2, max_steps=30, batch_seed=4, name="c"
    )
    opacus = train_candidate(config(grad_sample_mode="ghost", **settings), digits).record
    linear = train_candidate(config(grad_sample_mode=LINEAR_EXACT, **settings), digits).record
    # a batch seed drives a different stream in each engine's sampler: distinct batch lineages
    assert linear.batch_lineage == f"{opacus.batch_lineage}/{SAMPLER_ID}"
    assert linear == opacus.model_copy(
        update={"batch_lineage": linear.batch_lineage, "run_id": linear.run_id}
    )
    assert linear.expected_batch_size == int(digits.dataset_size * linear.sample_rate)


def test_validation_accuracy_matches_the_opacus_engine(digits: DatasetSplits) -> None:
    def accuracy(mode: str) -> float:
        runs = [
            train_candidate(config(epochs=10, noise_seed=seed, grad_sample_mode=mode), digits)
            for seed in range(3)
        ]
        return float(np.mean([run.metrics["validation_accuracy"] for run in runs]))

    linear, opacus = accuracy(LINEAR_EXACT), accuracy("ghost")
    assert linear > 0.8 and abs(linear - opacus) < 0.04
