"""Tensor-parallel Linear pair: complex operands are refused, on every worker before any message, with a message
that says so (the rings' backward does not conjugate); the layers then work."""

import pytest
import torch

from distdl.nn.linear_all_gather import DistributedLinearAllGather, all_gather_linear
from distdl.nn.linear_reduce_scatter import DistributedLinearReduceScatter, linear_reduce_scatter
from distdl.testing import random_tensor, scatter
from helpers import sizes

LAYERS = {"all_gather": DistributedLinearAllGather, "reduce_scatter": DistributedLinearReduceScatter}
COMPLEX = r"expected x and weight of one real floating dtype, got complex torch.complex128 \(complex is not supported\)"


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("overlap", [False, True])
@sizes(1, 2, 3)
def test_complex_layers_are_refused(P_world, comm, kind, overlap):
    P_x = P_world.create_cartesian_topology_partition((1, comm.size))
    name = LAYERS[kind].__name__
    layer = LAYERS[kind](P_x, 7, 5, overlap=overlap, dtype=torch.complex128)
    with pytest.raises(TypeError, match=rf"{name}: {COMPLEX}"):
        layer(scatter(random_tensor((3, 7), seed=1, dtype=torch.complex128), P_x))
    layer = LAYERS[kind](P_x, 7, 5, overlap=overlap, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"{name}: expected x and weight of one floating dtype, got "
                                        r"torch.complex128 and torch.float64"):
        layer(scatter(random_tensor((3, 7), seed=1, dtype=torch.complex128), P_x))
    assert layer(scatter(random_tensor((3, 7), seed=1), P_x)).dtype == torch.float64  # the messages pair up


@sizes(2)
def test_complex_rings_are_refused(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 2))
    x = torch.ones(3, 3 - comm.rank, dtype=torch.complex128)  # a balanced block of 5 features
    with pytest.raises(TypeError, match=rf"all_gather_linear: {COMPLEX}"):
        all_gather_linear(x, torch.ones(4, 5, dtype=torch.complex128), P_x, -1)
    with pytest.raises(TypeError, match=rf"linear_reduce_scatter: {COMPLEX}"):
        linear_reduce_scatter(x, torch.ones(4, 3 - comm.rank, dtype=torch.complex128), P_x, -1)
    y = all_gather_linear(x.real.contiguous(), torch.ones(4, 5, dtype=torch.float64), P_x, -1)
    assert torch.equal(y, torch.full((3, 4), 5.0, dtype=torch.float64))  # the messages pair up
