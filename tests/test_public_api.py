"""The small public API: ``dpmerge.<name>`` resolves lazily to the defining module."""

from __future__ import annotations

import subprocess
import sys

import pytest
from factories import make_record

import dpmerge
from dpmerge.accounting.calibration import calibrate


def test_import_is_light_and_names_resolve():
    code = (
        "import sys, dpmerge\n"
        "print([m for m in ('torch', 'dp_accounting', 'mlflow') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert dpmerge.calibrate is calibrate
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = dpmerge.nope


def test_calibrate_and_account_through_the_public_names():
    candidates = [make_record(f"c{s}", s, steps=200, sample_rate=0.01) for s in (1.0, 2.0)]
    plan = dpmerge.calibrate(candidates, "lc", 5.0, 1e-5)
    report = dpmerge.account(candidates, "lc", plan.weights, 1e-5)
    assert report.epsilon == plan.epsilon <= 5.0
    assert [u.members for u in dpmerge.release_units(candidates)] == [("c1.0",), ("c2.0",)]
