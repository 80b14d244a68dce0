"""Small helpers shared by the CLI modules."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from dpmerge.formatting import number_text


def float_list(text: str) -> list[float]:
    """Parse "0.5,1,2" into floats (argparse type); rejects empty items and non-numbers."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(math.isnan(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number ≥ 1 (argparse type), e.g. a dataset size; "1e4" and "2.0" are refused."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def probability(text: str) -> float:
    """A number strictly between 0 and 1 (argparse type), e.g. δ."""
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, allow_nan=False, ensure_ascii=False, default=str)
    sys.stdout.write("\n")


fmt = number_text
