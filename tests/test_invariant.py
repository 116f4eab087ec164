"""The invariant pair: forward and backward values, each the other's backward, and when each is right."""

import pytest
import torch

from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.functional.invariant import all_sum_reduce_backward, all_sum_reduce_forward
from distdl.nn.invariant import AllSumReduceBackward, AllSumReduceForward
from distdl.testing import random_tensor
from helpers import partition_shapes, sizes


@sizes(1, 2, 3, 4)
def test_forward_reduce_backward_identity(P_world, comm):
    n = comm.size
    for shape in partition_shapes(n):
        P_x = P_world.create_cartesian_topology_partition(shape)
        layer = AllSumReduceForward(P_x, axes_keep=[])
        x = random_tensor((3, 2), seed=comm.rank).requires_grad_()
        y = layer(x)
        torch.testing.assert_close(y, sum(random_tensor((3, 2), seed=r) for r in range(n)))
        dy = random_tensor((3, 2), seed=50 + comm.rank)
        y.backward(dy)
        torch.testing.assert_close(x.grad, dy, rtol=0, atol=0)


@sizes(1, 2, 3, 4)
def test_forward_identity_backward_reduce(P_world, comm):
    n = comm.size
    layer = AllSumReduceBackward(P_world, axes_reduce=[0])
    x = random_tensor((4,), seed=comm.rank).requires_grad_()
    y = layer(x)
    torch.testing.assert_close(y, x.detach(), rtol=0, atol=0)
    assert y.data_ptr() != x.data_ptr()
    dy = random_tensor((4,), seed=50 + comm.rank)
    y.backward(dy)
    torch.testing.assert_close(x.grad, sum(random_tensor((4,), seed=50 + r) for r in range(n)))


@sizes(1, 2, 3)
def test_outputs_take_in_place_ops(P_world, comm):
    """A bias added in place after the sum (Megatron's row-parallel layer): the output is a tensor of its own."""
    n = comm.size
    for f, forward_sum, backward_sum in ((all_sum_reduce_forward, True, False),
                                         (all_sum_reduce_backward, False, True)):
        x = random_tensor((4,), seed=comm.rank).requires_grad_()
        y = f(x, P_world, axes_reduce=[0])
        y += 1.0
        y.mul_(2)
        total = sum(random_tensor((4,), seed=r) for r in range(n))
        torch.testing.assert_close(y, 2 * ((total if forward_sum else x.detach()) + 1))
        dy = random_tensor((4,), seed=50 + comm.rank)
        y.backward(dy)
        summed = sum(random_tensor((4,), seed=50 + r) for r in range(n))
        torch.testing.assert_close(x.grad, 2 * (summed if backward_sum else dy))


@sizes(2, 3)
def test_each_is_the_others_backward(P_world, comm):
    """Double backward: the backward of the backward is the forward again."""
    for f, g in ((all_sum_reduce_forward, all_sum_reduce_backward), (all_sum_reduce_backward, all_sum_reduce_forward)):
        x = random_tensor((3,), seed=comm.rank).requires_grad_()
        dy = random_tensor((3,), seed=20 + comm.rank).requires_grad_()
        (dx,) = torch.autograd.grad(f(x, P_world, [0]), x, dy, create_graph=True)
        torch.testing.assert_close(dx, g(dy.detach(), P_world, [0]))
        v = random_tensor((3,), seed=40 + comm.rank)
        (dv,) = torch.autograd.grad(dx, dy, v)
        torch.testing.assert_close(dv, f(v, P_world, [0]))


@sizes(2, 3, 4)
def test_when_each_convention_is_right(P_world, comm):
    """A loss computed redundantly on every rank after a sum: the invariant form gives the true gradient
    of that (single) loss; the true adjoint counts each rank's identical cotangent once per rank."""
    n = comm.size
    x = random_tensor((5,), seed=comm.rank).requires_grad_()
    (all_sum_reduce_forward(x, P_world, [0]) ** 2).sum().backward()
    total = sum(random_tensor((5,), seed=r) for r in range(n))
    torch.testing.assert_close(x.grad, 2 * total)  # d/dx_i of (sum_j x_j)^2
    x.grad = None
    (all_sum_reduce(x, P_world, [0]) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, n * 2 * total)


@sizes(1, 3)
def test_errors_and_inactive(P_world, comm):
    with pytest.raises(ValueError, match="all_sum_reduce_forward: expected exactly one of axes_reduce"):
        all_sum_reduce_forward(torch.ones(1), P_world)
    with pytest.raises(ValueError, match=r"AllSumReduceBackward: expected axes in"):
        AllSumReduceBackward(P_world, axes_reduce=[3])
    P_x = P_world.create_partition_inclusive([0])
    y = AllSumReduceBackward(P_x, axes_reduce=[0])(torch.ones(2) if P_x.active else torch.zeros(0))
    assert y.shape == ((2,) if P_x.active else (0,))
