"""Exact sums of float64s: kept as a Python int in units of 2**-1126, the unit every finite
float64 is a whole multiple of, so that sums of any split of the values, added in any order,
are the very sum of all of them; handed on as a few floats whose exact sum it is."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]

_SHIFT = 1126
"""Every finite float64 is a whole multiple of 2**-1126 (frexp's least exponent, -1073, less
its 53 bits of mantissa): a sum of them, counted in that unit, is a Python int, exact."""
_UNIT = 1 << _SHIFT
_SHIFTS = 1024 + _SHIFT - 53 + 1
"""Exponents of finite float64s in that unit: frexp's greatest exponent is 1024."""
_HALF = 26


def exact_sum(x: Floats) -> int:
    """The exact sum of finite values, in units of 2**-1126. Vectorised: values are grouped
    by exponent and their integer mantissas summed in int64 halves (27 bits each, so no
    overflow below 2**36 rows), then the few groups are added as Python ints."""
    mantissa, exponent = np.frexp(x)
    m = (mantissa * 2.0**53).astype(np.int64)  # exact: a mantissa has 53 bits
    shift = exponent + (_SHIFT - 53)  # value = m * 2**shift units, shift in [0, _SHIFTS)
    high = np.zeros(_SHIFTS, dtype=np.int64)
    low = np.zeros(_SHIFTS, dtype=np.int64)
    np.add.at(high, shift, m >> _HALF)
    np.add.at(low, shift, m & ((1 << _HALF) - 1))
    total = 0
    for s in np.flatnonzero(high | low).tolist():
        total += ((int(high[s]) << _HALF) + int(low[s])) << s
    return total


def as_floats(total: int) -> list[float]:
    """An exact sum as floats whose exact sum it is, greedily from the largest: one float
    when the sum is one, rarely more than three. Canonical: equal sums, equal lists."""
    out: list[float] = []
    while total:
        try:
            f = total / _UNIT  # correctly rounded
        except OverflowError:  # beyond the largest float: a sum of huge values
            f = 2.0**1023 if total > 0 else -(2.0**1023)
        out.append(f)
        total -= units([f])
    return out


def units(floats: list[float]) -> int:
    """The exact sum of finite floats, in units of 2**-1126."""
    total = 0
    for f in floats:
        p, q = float(f).as_integer_ratio()  # q: a power of two, at most 2**1074
        total += p * (_UNIT // q)
    return total


def quotient(total: int, n: int) -> float:
    """total (in units) / n, correctly rounded; +-inf beyond the largest float."""
    try:
        return total / (n * _UNIT)
    except OverflowError:
        return math.inf if total > 0 else -math.inf
