"""Merging (docs/design.md#random-selection RS, §5 LC): exact arithmetic, refusals, secrecy of the
RS draw, streaming."""

from __future__ import annotations

import json
import math
import os
import random
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from factories import make_record
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from dpmerge import merging
from dpmerge.accounting.account import account
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.records import MechanismRecord
from dpmerge.artifacts import ModelSpec, load_model_dir, save_model_dir
from dpmerge.errors import InputError, RecordError
from dpmerge.merging import RELEASE_NONCE, draw_index, linear_combination, merge_model_dirs

SPEC = ModelSpec("logreg", (4,), 3)
DELTA = 1e-5


def record(name: str, sigma: float = 1.0) -> MechanismRecord:
    return make_record(
        name, sigma, steps=20, sample_rate=0.01, learning_rate=0.1, batch=10.0, dataset="toy"
    )


def logreg_weights(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "linear.weight": torch.randn(3, 4, generator=generator).to(dtype),
        "linear.bias": torch.randn(3, generator=generator).to(dtype),
    }


def candidate(
    root: Path, name: str, weights: dict[str, torch.Tensor], spec: ModelSpec = SPEC, sigma=1.0
) -> Path:
    return save_model_dir(root / name, weights, spec, record=record(name, sigma))


def weights_file(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    path = root / f"{name}.safetensors"
    save_file(tensors, str(path))
    return path


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(
            a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)
        ), key


def json_keys(value: object) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(json_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(json_keys(v) for v in value))
    return set()


# ----- exact arithmetic ------------------------------------------------------------------------


def test_one_hot_weights_reproduce_the_candidate_bit_for_bit(tmp_path: Path) -> None:
    special = torch.tensor([-0.0, 0.0, 1e-45, -3.0e38, 1.0 + 2**-23, -(2**-149)])
    tensors = [{"w": torch.cat([torch.randn(50), special]), "n": torch.arange(3)} for _ in "abc"]
    files = [weights_file(tmp_path, str(i), t) for i, t in enumerate(tensors)]
    for index in range(3):
        one_hot = [float(i == index) for i in range(3)]
        assert_bitwise_equal(linear_combination(files, one_hot), tensors[index])


def test_lc_of_two_models_equals_the_hand_computed_sum(tmp_path: Path) -> None:
    # Quarter-integers and weights 1/4, 3/4: every product and sum is exact in float32.
    a = {"w": torch.arange(-8, 8, dtype=torch.float32) / 4}
    b = {"w": torch.arange(8, -8, -1, dtype=torch.float32) / 2}
    files = [weights_file(tmp_path, "a", a), weights_file(tmp_path, "b", b)]
    merged = linear_combination(files, [0.25, 0.75])
    assert torch.equal(merged["w"], 0.25 * a["w"] + 0.75 * b["w"])

    x, y = logreg_weights(1), logreg_weights(2)
    files = [weights_file(tmp_path, "x", x), weights_file(tmp_path, "y", y)]
    merged = linear_combination(files, [0.3, 0.7])
    for key in x:
        expected = (0.3 * x[key].double() + 0.7 * y[key].double()).float()
        torch.testing.assert_close(merged[key], expected, rtol=2e-7, atol=1e-7)


def test_half_precision_is_accumulated_in_float32_and_cast_back(tmp_path: Path) -> None:
    a, b = logreg_weights(1, torch.bfloat16), logreg_weights(2, torch.bfloat16)
    files = [weights_file(tmp_path, "a", a), weights_file(tmp_path, "b", b)]
    merged = linear_combination(files, [0.5, 0.5])
    for key in a:
        assert merged[key].dtype == torch.bfloat16
        expected = (0.5 * a[key].float() + 0.5 * b[key].float()).to(torch.bfloat16)
        assert torch.equal(merged[key], expected)


def test_integer_buffers_are_copied_when_equal_and_refused_when_not(tmp_path: Path) -> None:
    a = {"w": torch.ones(2), "step": torch.tensor([7]), "mask": torch.tensor([True, False])}
    b = {"w": torch.zeros(2), "step": torch.tensor([7]), "mask": torch.tensor([True, False])}
    files = [weights_file(tmp_path, "a", a), weights_file(tmp_path, "b", b)]
    merged = linear_combination(files, [0.5, 0.5])
    assert torch.equal(merged["step"], a["step"]) and torch.equal(merged["mask"], a["mask"])
    c = {**b, "step": torch.tensor([8])}
    with pytest.raises(RecordError, match="non-float tensor 'step' differs"):
        linear_combination([files[0], weights_file(tmp_path, "c", c)], [0.5, 0.5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_merge_matches_cpu(tmp_path: Path) -> None:
    files = [weights_file(tmp_path, str(i), logreg_weights(i)) for i in range(3)]
    cpu = linear_combination(files, [0.2, 0.3, 0.5])
    gpu = linear_combination(files, [0.2, 0.3, 0.5], device="cuda")
    for key in cpu:
        assert gpu[key].device.type == "cuda"
        torch.testing.assert_close(gpu[key].cpu(), cpu[key], rtol=1e-6, atol=1e-7)
    one_hot = linear_combination(files, [0.0, 1.0, 0.0], device="cuda")
    assert_bitwise_equal({k: v.cpu() for k, v in one_hot.items()}, load_file(str(files[1])))


# ----- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([0.5, 0.6], "sum to"),
        ([1.5, -0.5], "negative"),
        ([float("nan"), 1.0], "finite"),
        ([float("inf"), 0.0], "finite"),
        ([1.0], "expected 2 values"),
    ],
)
def test_weights_off_the_simplex_are_refused(tmp_path: Path, weights, message) -> None:
    dirs = [candidate(tmp_path, n, logreg_weights(i)) for i, n in enumerate("ab")]
    out = tmp_path / "out"
    with pytest.raises(RecordError, match=message):
        merge_model_dirs(dirs, "lc", weights, out, delta=DELTA)
    assert not out.exists()


def test_weights_are_never_renormalised(tmp_path: Path) -> None:
    files = [weights_file(tmp_path, n, logreg_weights(i)) for i, n in enumerate("ab")]
    with pytest.raises(RecordError, match="simplex"):
        linear_combination(files, [1.0, 1.0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("weights", [[0.5, 0.5], [1.0, 0.0]])
def test_non_finite_candidate_weights_are_refused(tmp_path: Path, bad, weights) -> None:
    broken = logreg_weights(2)
    broken["linear.weight"][1, 2] = bad
    dirs = [candidate(tmp_path, "a", logreg_weights(1)), candidate(tmp_path, "b", broken)]
    out = tmp_path / "out"
    with pytest.raises(RecordError, match=r"b: tensor 'linear.weight' contains NaN or inf"):
        merge_model_dirs(dirs, "lc", weights, out, delta=DELTA)
    assert not out.exists()


def test_an_overflowing_sum_is_refused(tmp_path: Path) -> None:
    # float32(1/6) rounds up, so six copies of the largest float32 sum past it.
    big = {"w": torch.full((1,), torch.finfo(torch.float32).max)}
    files = [weights_file(tmp_path, n, big) for n in "abcdef"]
    with pytest.raises(RecordError, match="overflowed in tensor 'w'"):
        linear_combination(files, [1 / 6] * 6)


def test_mismatched_architectures_are_refused(tmp_path: Path) -> None:
    other = ModelSpec("logreg", (5,), 3)
    wide = {"linear.weight": torch.zeros(3, 5), "linear.bias": torch.zeros(3)}
    dirs = [candidate(tmp_path, "a", logreg_weights(1)), candidate(tmp_path, "b", wide, other)]
    with pytest.raises(RecordError, match="architectures differ"):
        merge_model_dirs(dirs, "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    assert not (tmp_path / "out").exists()


def test_a_record_disagreeing_with_its_weights_is_refused(tmp_path: Path) -> None:
    cnn = ModelSpec("cnn", (1, 8, 8), 3)
    dirs = [candidate(tmp_path, "a", logreg_weights(1), cnn), candidate(tmp_path, "b", {})]
    with pytest.raises(RecordError, match=r"a: weights do not match model.json.*cnn"):
        merge_model_dirs(dirs, "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    truncated = {"linear.weight": torch.zeros(3, 4)}
    dirs = [candidate(tmp_path, "c", logreg_weights(1)), candidate(tmp_path, "d", truncated)]
    with pytest.raises(RecordError, match=r"d: weights do not match.*missing linear\.bias"):
        merge_model_dirs(dirs, "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    assert not (tmp_path / "out").exists()


def test_dtype_mismatch_is_refused(tmp_path: Path) -> None:
    dirs = [
        candidate(tmp_path, "a", logreg_weights(1)),
        candidate(tmp_path, "b", logreg_weights(2, torch.float64)),
    ]
    with pytest.raises(RecordError, match=r"b: key 'linear\.\w+' has dtype torch.float64"):
        merge_model_dirs(dirs, "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    assert not (tmp_path / "out").exists()


def test_missing_keys_and_shape_mismatch_are_named(tmp_path: Path) -> None:
    a = weights_file(tmp_path, "a", logreg_weights(1))
    missing = weights_file(tmp_path, "m", {"linear.weight": torch.zeros(3, 4)})
    with pytest.raises(RecordError, match=r"m\.safetensors: missing key 'linear\.bias'"):
        linear_combination([a, missing], [0.5, 0.5])
    shape = {"linear.weight": torch.zeros(4, 3), "linear.bias": torch.zeros(3)}
    with pytest.raises(RecordError, match=r"key 'linear.weight' has shape \[4, 3\], expected"):
        linear_combination([a, weights_file(tmp_path, "s", shape)], [0.5, 0.5])


def test_batchnorm_statistics_are_refused(tmp_path: Path) -> None:
    tensors = {"bn.weight": torch.ones(2), "bn.running_mean": torch.zeros(2)}
    files = [weights_file(tmp_path, n, tensors) for n in "ab"]
    with pytest.raises(RecordError, match=r"BatchNorm.*GroupNorm"):
        linear_combination(files, [0.5, 0.5])


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    a, b = (candidate(tmp_path, n, logreg_weights(i)) for i, n in enumerate("ab"))
    with pytest.raises(RecordError, match="given twice"):
        merge_model_dirs([a, a], "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    with pytest.raises(InputError, match="method must be"):
        merge_model_dirs([a, b], "avg", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    with pytest.raises(RecordError, match="needs its calibration"):
        merge_model_dirs([a, b], "mixture", [0.5, 0.5], tmp_path / "out", delta=DELTA)
    with pytest.raises(RecordError, match="LC has no secret"):
        merge_model_dirs(
            [a, b], "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA, audit_path=tmp_path / "x"
        )
    merged = merge_model_dirs([a, b], "lc", [0.5, 0.5], tmp_path / "out", delta=DELTA).path
    with pytest.raises(RecordError, match="already exists"):
        merge_model_dirs([a, b], "lc", [0.5, 0.5], merged, delta=DELTA)
    with pytest.raises(RecordError, match="a merged model, not a candidate"):
        merge_model_dirs([a, merged], "lc", [0.5, 0.5], tmp_path / "out2", delta=DELTA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]


# ----- the released directory ------------------------------------------------------------------


def test_lc_release_records_method_weights_candidates_and_privacy(tmp_path: Path) -> None:
    dirs = [
        candidate(tmp_path, n, logreg_weights(i), sigma=s)
        for i, (n, s) in enumerate([("a", 1.0), ("b", 2.0)])
    ]
    result = merge_model_dirs(
        dirs,
        "lc",
        [0.25, 0.75],
        tmp_path / "out",
        delta=DELTA,
        metrics=lambda spec, weights: {"keys": sorted(weights)},
    )
    loaded = load_model_dir(result.path)
    assert loaded.spec == SPEC and loaded.metrics == {"keys": ["linear.bias", "linear.weight"]}
    assert loaded.merge["method"] == "lc" and loaded.merge["weights"] == [0.25, 0.75]
    assert [c["source"] for c in loaded.merge["candidates"]] == ["a", "b"]
    assert loaded.merge["candidates"][1]["record"]["noise_multiplier"] == 2.0
    expected = account([record("a", 1.0), record("b", 2.0)], "lc", [0.25, 0.75], DELTA)
    assert loaded.privacy == json.loads(json.dumps(expected.to_dict()))
    by_hand = {
        k: 0.25 * load_file(str(dirs[0] / "weights.safetensors"))[k]
        + 0.75 * load_file(str(dirs[1] / "weights.safetensors"))[k]
        for k in loaded.weights
    }
    for key, value in loaded.weights.items():
        torch.testing.assert_close(value, by_hand[key])


def test_a_calibration_supplies_weights_and_its_report(tmp_path: Path) -> None:
    dirs = [
        candidate(tmp_path, n, logreg_weights(i), sigma=s)
        for i, (n, s) in enumerate([("a", 1.0), ("b", 2.0)])
    ]
    calibration = calibrate([record("a", 1.0), record("b", 2.0)], "lc", 5.0, DELTA)
    result = merge_model_dirs(dirs, "lc", calibration, tmp_path / "out", delta=DELTA)
    loaded = load_model_dir(result.path)
    assert tuple(loaded.merge["weights"]) == calibration.weights
    assert loaded.merge["calibration"]["target_epsilon"] == 5.0
    assert loaded.privacy["epsilon"] == pytest.approx(calibration.epsilon)
    with pytest.raises(RecordError, match="calibration is for lc"):
        merge_model_dirs(dirs, "lc", calibration, tmp_path / "out2", delta=1e-6)
    assert not (tmp_path / "out2").exists()


def test_rs_releases_the_drawn_candidate_and_keeps_the_index_out_of_public_files(
    tmp_path: Path,
) -> None:
    dirs = [candidate(tmp_path, n, logreg_weights(i)) for i, n in enumerate("abc")]
    pi = [0.2, 0.3, 0.5]
    seeds = {draw_index(pi, rng=random.Random(seed)): seed for seed in range(50)}
    assert len(seeds) == 3
    public: dict[int, dict[str, bytes]] = {}
    for index, seed in seeds.items():
        audit = tmp_path / f"audit-{index}.json"
        result = merge_model_dirs(
            dirs,
            "rs",
            pi,
            tmp_path / f"rs-{index}",
            delta=DELTA,
            audit_path=audit,
            audit_notes={"note": "internal"},
            rng=random.Random(seed),
        )
        assert result.drawn_index == index and "drawn_index" not in repr(result)
        released, drawn = result.path / "weights.safetensors", dirs[index] / "weights.safetensors"
        assert_bitwise_equal(load_file(str(released)), load_file(str(drawn)))
        # the same tensors, written afresh: the file (an object store's ETag) differs
        assert released.read_bytes() != drawn.read_bytes()
        with safe_open(str(released), framework="pt") as handle:
            assert len(handle.metadata()[RELEASE_NONCE]) == 32
        assert stat.S_IMODE(audit.stat().st_mode) == 0o600
        content = json.loads(audit.read_text())
        assert content["drawn_index"] == index and content["drawn_candidate"] == "abc"[index]
        assert content["notes"] == {"note": "internal"}
        public[index] = {
            p.name: p.read_bytes() for p in result.path.iterdir() if p.suffix == ".json"
        }
        assert set(public[index]) == {"model.json", "record.json", "privacy.json", "metrics.json"}
        keys = set().union(*(json_keys(json.loads(v)) for v in public[index].values()))
        assert not {k for k in keys if any(w in k for w in ("drawn", "index", "selected"))}
    # Every public file is byte-identical whichever candidate was drawn.
    assert public[0] == public[1] == public[2]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_mixture_draws_one_rung_once_and_its_public_files_do_not_say_which(
    tmp_path: Path,
) -> None:
    """The draw callback is called exactly once with the rungs' odds; the released weights are
    the drawn rung's LC merge; every public file is byte-identical whichever rung was drawn; the
    audit record (0600) names the rung."""
    sigmas = {"a": 1.0, "b": 2.0, "c": 4.0}
    dirs = [
        candidate(tmp_path, n, logreg_weights(i), sigma=s)
        for i, (n, s) in enumerate(sigmas.items())
    ]
    calibration = calibrate([record(n, s) for n, s in sigmas.items()], "mixture", 0.3, DELTA)
    rungs = calibration.rungs
    assert len(rungs) == 2
    public: dict[int, dict[str, bytes]] = {}
    for index in (0, 1):
        calls: list[list[float]] = []

        def draw(odds, index=index, calls=calls):
            calls.append(list(odds))
            return index

        audit = tmp_path / f"audit-{index}.json"
        result = merge_model_dirs(
            dirs,
            "mixture",
            calibration,
            tmp_path / f"mix-{index}",
            delta=DELTA,
            audit_path=audit,
            draw=draw,
            metrics=lambda spec, weights: {"keys": sorted(weights)},
        )
        assert calls == [[r.probability for r in rungs]]
        assert result.drawn_index == index and result.weights == ()
        expected = linear_combination(
            [d / "weights.safetensors" for d in dirs], rungs[index].weights
        )
        assert_bitwise_equal(load_file(str(result.path / "weights.safetensors")), expected)
        content = json.loads(audit.read_text())
        assert stat.S_IMODE(audit.stat().st_mode) == 0o600
        assert content["drawn_index"] == index and content["method"] == "mixture"
        assert content["drawn_rung"] == list(rungs[index].members(calibration.report.names))
        public[index] = {
            p.name: p.read_bytes() for p in result.path.iterdir() if p.suffix == ".json"
        }
        loaded = load_model_dir(result.path)
        assert loaded.merge["method"] == "mixture" and loaded.merge["weights"] is None
        assert [r["probability"] for r in loaded.merge["rungs"]] == [r.probability for r in rungs]
        assert loaded.privacy["epsilon"] == calibration.epsilon <= 0.3
    assert public[0] == public[1]
    keys = set().union(*(json_keys(json.loads(v)) for v in public[0].values()))
    assert not {k for k in keys if any(w in k for w in ("drawn", "index", "selected"))}


def test_rs_audit_file_must_lie_outside_the_release_and_be_new(tmp_path: Path) -> None:
    dirs = [candidate(tmp_path, n, logreg_weights(i)) for i, n in enumerate("ab")]
    out = tmp_path / "out"
    with pytest.raises(RecordError, match="outside the released directory"):
        merge_model_dirs(dirs, "rs", [0.5, 0.5], out, delta=DELTA, audit_path=out / "a.json")
    existing = tmp_path / "audit.json"
    existing.write_text("{}")
    with pytest.raises(RecordError, match="already exists"):
        merge_model_dirs(dirs, "rs", [0.5, 0.5], out, delta=DELTA, audit_path=existing)
    assert not out.exists() and existing.read_text() == "{}"


def test_rs_draw_frequencies_match_pi() -> None:
    pi = [0.1, 0.0, 0.25, 0.65]
    rng = random.Random(12345)
    draws = 20_000
    counts = Counter(draw_index(pi, rng=rng) for _ in range(draws))
    assert counts[1] == 0
    observed = [counts[i] for i in (0, 2, 3)]
    expected = [draws * pi[i] for i in (0, 2, 3)]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_rs_draws_from_the_system_rng_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    used = []

    class Recording(random.SystemRandom):
        def choices(self, *args, **kwargs):
            used.append(kwargs["k"])
            return super().choices(*args, **kwargs)

    monkeypatch.setattr(merging.secrets, "SystemRandom", Recording)
    assert draw_index([0.0, 1.0]) == 1
    assert used == [1]


# ----- streaming -------------------------------------------------------------------------------


def test_candidates_are_streamed_one_file_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [weights_file(tmp_path, str(i), logreg_weights(i)) for i in range(4)]
    real_open, open_now, most = merging.safe_open, set(), [0]

    class Tracked:
        def __init__(self, path: str, **kwargs) -> None:
            self.path, self.handle = path, real_open(path, **kwargs)

        def __enter__(self):
            open_now.add(self.path)
            most[0] = max(most[0], len(open_now))
            return self.handle.__enter__()

        def __exit__(self, *exc):
            open_now.discard(self.path)
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(merging, "safe_open", Tracked)
    merged = linear_combination(files, [0.25] * 4)
    assert most[0] == 1 and not open_now
    assert merged.keys() == {"linear.weight", "linear.bias"}


def test_each_handle_reads_one_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handle keeps every page it read resident until it closes, so each is opened for one
    piece: with pieces of one 4-float row, the 3 × 4 weight takes 3 reads and the bias 1, per
    candidate."""
    files = [weights_file(tmp_path, str(i), logreg_weights(i)) for i in range(3)]
    real_open, reads = merging.safe_open, []

    class Counting:
        def __init__(self, path: str, **kwargs) -> None:
            self.handle, self.reads = real_open(path, **kwargs), 0

        def __enter__(self):
            inner = self.handle.__enter__()
            outer = self

            class Handle:
                def get_tensor(self, key):
                    outer.reads += 1
                    return inner.get_tensor(key)

                def get_slice(self, key):
                    outer.reads += 1
                    return inner.get_slice(key)

            return Handle()

        def __exit__(self, *exc):
            reads.append(self.reads)
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(merging, "safe_open", Counting)
    monkeypatch.setattr(merging, "PIECE_BYTES", 16)
    linear_combination(files, [0.2, 0.3, 0.5])
    assert reads == [1] * (3 * (3 + 1))


def in_memory_merge(
    tensors: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """The merge as it was computed before streaming: whole models, candidate by candidate,
    into float32 (float64) sums that the first contributing candidate initialises."""
    merged: dict[str, torch.Tensor] = {}
    for key, first in tensors[0].items():
        if not first.is_floating_point():
            merged[key] = first.clone()
            continue
        total = None
        for model, weight in zip(tensors, weights, strict=True):
            value = model[key].to(torch.promote_types(first.dtype, torch.float32))
            if weight == 0:
                continue
            if total is None:
                total = value.clone() if weight == 1 else value * weight
            else:
                total.add_(value, alpha=weight)
        assert total is not None
        merged[key] = total.to(first.dtype)
    return merged


def mixed_model(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of every kind a merge streams: matrices split into many pieces, a 4-d kernel,
    a vector, a scalar, empty tensors, half and double precision, signed zeros, an integer
    buffer."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    signed = randn(40)
    signed[::7] = -0.0
    return {
        "matrix": randn(37, 23),
        "kernel": randn(8, 3, 5, 5),
        "signed": signed,
        "scalar": randn(()),
        "empty": randn(0, 3),
        "hollow": randn(4, 0),
        "half": randn(19, 9).to(torch.float16),
        "brain": randn(11, 13).to(torch.bfloat16),
        "double": randn(17, 5).double(),
        "steps": torch.arange(6),
    }


@pytest.mark.parametrize("piece_bytes", [1, 100, merging.PIECE_BYTES])
def test_the_streamed_merge_equals_the_in_memory_merge_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece_bytes: int
) -> None:
    monkeypatch.setattr(merging, "PIECE_BYTES", piece_bytes)
    tensors = [mixed_model(seed) for seed in range(5)]
    files = [weights_file(tmp_path, str(i), t) for i, t in enumerate(tensors)]
    weight_sets = [
        [0.2] * 5,
        [0.1, 0.0, 0.35, 0.05, 0.5],
        [0.0, 0.0, 1.0, 0.0, 0.0],
        [1 / 3, 1 / 7, 0.0, 1 - 1 / 3 - 1 / 7 - 1 / 11, 1 / 11],
    ]
    expected = [in_memory_merge(tensors, w) for w in weight_sets]
    for weights, reference in zip(weight_sets, expected, strict=True):
        assert_bitwise_equal(linear_combination(files, weights), reference)
    for keep, reference in enumerate(expected):
        merged = merging.linear_combinations(files, weight_sets, keep=keep)
        assert_bitwise_equal(merged, reference)
    # and close to the exact sum (float64, whole models): float32 rounding only
    exact = sum(w * t["matrix"].double() for w, t in zip(weight_sets[3], tensors, strict=True))
    torch.testing.assert_close(expected[3]["matrix"].double(), exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("keep", [0, 1])
def test_every_weight_vector_is_checked_whichever_is_kept(tmp_path: Path, keep: int) -> None:
    broken = logreg_weights(2)
    broken["linear.bias"][1] = float("nan")
    files = [weights_file(tmp_path, n, t) for n, t in (("a", logreg_weights(1)), ("b", broken))]
    with pytest.raises(RecordError, match=r"b.safetensors: tensor 'linear.bias' contains NaN"):
        merging.linear_combinations(files, [[1.0, 0.0], [0.5, 0.5]], keep=keep)
    with pytest.raises(RecordError, match="keep must be the index"):
        merging.linear_combinations(files[:1], [[1.0]], keep=True)


def test_rs_and_mixture_releases_equal_the_in_memory_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merging, "PIECE_BYTES", 16)  # one row of the 3 × 4 weight
    sigmas = {"a": 1.0, "b": 2.0, "c": 4.0}
    tensors = [logreg_weights(i) for i in range(3)]
    dirs = [
        candidate(tmp_path, n, t, sigma=s)
        for t, (n, s) in zip(tensors, sigmas.items(), strict=True)
    ]
    calibration = calibrate([record(n, s) for n, s in sigmas.items()], "mixture", 0.3, DELTA)
    for index, rung in enumerate(calibration.rungs):
        result = merge_model_dirs(
            dirs,
            "mixture",
            calibration,
            tmp_path / f"mix-{index}",
            delta=DELTA,
            audit_path=tmp_path / f"mix-{index}.json",
            draw=lambda odds, index=index: index,
        )
        released = load_file(str(result.path / "weights.safetensors"))
        assert_bitwise_equal(released, in_memory_merge(tensors, list(rung.weights)))
    for index in range(3):
        result = merge_model_dirs(
            dirs,
            "rs",
            [0.2, 0.3, 0.5],
            tmp_path / f"rs-{index}",
            delta=DELTA,
            audit_path=tmp_path / f"rs-{index}.json",
            draw=lambda odds, index=index: index,
        )
        assert_bitwise_equal(load_file(str(result.path / "weights.safetensors")), tensors[index])


PEAK_RSS_CHILD = """
import gc, sys
from pathlib import Path
from dpmerge.merging import linear_combination

def status(field):
    lines = Path("/proc/self/status").read_text().splitlines()
    line = next(x for x in lines if x.startswith(field))
    return int(line.split()[1]) * 1024

files = sys.argv[1:]
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS:")
merged = linear_combination(files, [1 / len(files)] * len(files))
print(status("VmHWM:") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_stays_under_one_and_a_half_models(tmp_path: Path) -> None:
    """Measured in a fresh interpreter; the whole-file streaming it replaces grew by 2.0× one
    model (the output plus one candidate's mapped pages)."""
    shapes = {f"layer{i}.weight": (1024, 1024) for i in range(12)} | {"head.bias": (1000,)}
    shapes["embedding.weight"] = (8192, 1024)  # 32 MiB: read in pieces
    model_bytes = 4 * sum(math.prod(s) for s in shapes.values())
    files = []
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        tensors = {k: torch.randn(s, generator=generator) for k, s in shapes.items()}
        files.append(str(weights_file(tmp_path, str(seed), tensors)))
    del tensors
    child = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_CHILD, *files],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    growth = int(child.stdout)
    assert 0.9 * model_bytes < growth <= 1.5 * model_bytes, growth / model_bytes
