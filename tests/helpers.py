"""Shared test helpers."""

import pytest
import torch

FLOAT_DTYPES = (torch.float32, torch.float64)


def sizes(*ns):
    """Run a test taking ``comm``/``P_world`` at each of these world sizes (exactly that many ranks)."""
    return pytest.mark.parametrize("comm", [pytest.param(n, marks=pytest.mark.mpi(min_size=n), id=f"{n}ranks")
                                            for n in ns], indirect=True)


def partition_shapes(n):
    """Cartesian shapes of 1-3 dimensions with n workers."""
    return {1: [(1,), (1, 1), (1, 1, 1)], 2: [(2,), (1, 2), (2, 1, 1)], 3: [(3,), (3, 1), (1, 1, 3)],
            4: [(4,), (2, 2), (1, 2, 2), (4, 1)]}[n]
