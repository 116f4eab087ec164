"""The balanced decomposition helpers and zero-volume tensors (serial)."""

import numpy as np
import pytest
import torch

from distdl.utilities.slicing import compute_start_index, compute_stop_index, compute_subshape
from distdl.utilities.torch import zero_volume_tensor


@pytest.mark.parametrize("P_shape,shape", [((3,), (10,)), ((2, 3), (5, 7)), ((4,), (2,)), ((1, 2, 2), (3, 0, 5))])
def test_blocks_tile_the_global_tensor(P_shape, shape):
    covered = np.zeros(shape, dtype=int)
    for index in np.ndindex(*P_shape):
        start = compute_start_index(P_shape, index, shape)
        stop = compute_stop_index(P_shape, index, shape)
        sub = compute_subshape(P_shape, index, shape)
        assert np.array_equal(stop - start, sub)
        # Balanced: extents differ by at most one, the first n % p workers hold the extra one.
        assert np.array_equal(sub, np.array(shape) // P_shape + (np.array(index) < np.array(shape) % P_shape))
        covered[tuple(slice(a, b) for a, b in zip(start, stop))] += 1
    assert np.all(covered == 1)


def test_slicing_errors():
    with pytest.raises(ValueError, match="compute_subshape: expected P_shape, index and shape of one length"):
        compute_subshape((2, 2), (0,), (4, 4))
    with pytest.raises(ValueError, match="compute_start_index: expected an index inside P_shape"):
        compute_start_index((2,), (2,), (4,))


def test_zero_volume_tensor():
    assert zero_volume_tensor().shape == (0,)
    t = zero_volume_tensor(3, dtype=torch.float64, requires_grad=True)
    assert t.shape == (3, 0) and t.dtype == torch.float64 and t.requires_grad and t.numel() == 0
    assert zero_volume_tensor(dtype=torch.int64).dtype == torch.int64
    assert zero_volume_tensor(np.int64(2)).shape == (2, 0)
    for bad in ("4", 4.0, True, torch.tensor(4)):
        with pytest.raises(TypeError, match=r"zero_volume_tensor: expected None or an int for b, got "):
            zero_volume_tensor(bad)
    with pytest.raises(ValueError, match="zero_volume_tensor: expected b >= 0, got -1"):
        zero_volume_tensor(-1)
