"""DistributedMaxPool/AvgPool 1d/2d/3d: forward and input gradient equal torch's on the gathered tensors."""

import re

import pytest
import torch

from distdl.nn import pooling
from distdl.testing import assert_adjoint, assert_sequential_equivalence, random_tensor, scatter
from helpers import sizes

# (partition shape, global input shape, common kwargs, extra max kwargs, extra avg kwargs): uneven splits,
# split batch and channel axes, 2-d and 3-d partitions, blocks smaller than the window, empty output blocks.
CASES = {
    1: [((1, 1, 1, 1), (2, 2, 6, 5), dict(kernel_size=3, stride=2, padding=1), dict(dilation=(1, 2)),
         dict(count_include_pad=False))],
    2: [((1, 1, 2, 1), (1, 2, 7, 5), dict(kernel_size=2), {}, {}),
        ((1, 1, 2, 1), (1, 2, 5, 1), dict(kernel_size=2, stride=2, ceil_mode=True), {}, {}),  # 1 column, kernel 2
        ((2, 1, 1), (3, 2, 9), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), dict(dilation=2),
         dict(count_include_pad=False)),
        ((1, 2, 1), (1, 3, 7), dict(kernel_size=3), {}, {})],
    3: [((1, 1, 3), (1, 2, 5), dict(kernel_size=5, stride=1, padding=2), {}, dict(count_include_pad=False)),
        ((1, 1, 1, 3), (1, 2, 4, 8), dict(kernel_size=(2, 3), stride=2, padding=1, ceil_mode=True), {},
         dict(divisor_override=4)),
        ((1, 1, 1, 3, 1), (1, 1, 3, 5, 4), dict(kernel_size=2), {}, {}),
        # worker 0's window is 2 wide for a kernel 3 wide: avg_pool3d refuses it unless padded first
        ((1, 1, 1, 1, 3), (1, 2, 3, 3, 5), dict(kernel_size=3, padding=1), {}, dict(count_include_pad=False))],
    4: [((1, 1, 2, 2), (2, 2, 7, 6), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), dict(dilation=2),
         dict(count_include_pad=False)),
        ((1, 1, 4), (1, 2, 5), dict(kernel_size=5, stride=1, padding=2), {}, {}),  # 5 pixels, 4 workers, kernel 5
        ((1, 1, 4), (1, 2, 9), dict(kernel_size=3, stride=4), {}, {}),  # 2 outputs over 4 workers
        ((2, 2, 1, 1), (3, 3, 5, 4), dict(kernel_size=2), {}, {}),
        ((1, 1, 1, 2, 2), (1, 2, 3, 4, 5), dict(kernel_size=3, stride=2, padding=1), {}, dict(ceil_mode=True))],
}


def _layers(kind, dims, P_x, **kwargs):
    name = f"{kind}Pool{dims}d"
    return getattr(pooling, "Distributed" + name)(P_x, **kwargs), getattr(torch.nn, name)(**kwargs)


def _check(P_x, layer, ref, x_shape, dtype=torch.float64, tol=1e-12, calls=2):
    for call in range(calls):
        shape = (x_shape[0] + call,) + tuple(x_shape[1:])  # the same layer with a larger batch
        assert_sequential_equivalence(layer, ref, random_tensor(shape, seed=call).to(dtype), P_x, P_x, seed=call,
                                      rtol=tol, atol=tol)


@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for P_shape, x_shape, kwargs, max_kwargs, avg_kwargs in CASES[comm.size]:
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        dims = len(P_shape) - 2
        for kind, extra in (("Max", {}), ("Max", max_kwargs), ("Avg", {}), ("Avg", avg_kwargs)):
            if extra or kind == "Max" and not max_kwargs or kind == "Avg" and not avg_kwargs:
                _check(P_x, *_layers(kind, dims, P_x, **kwargs, **extra), x_shape)


@sizes(1, 2, 3, 4)
def test_adjoint_and_dtypes(P_world, comm):
    P_shape, x_shape, kwargs, _, avg_kwargs = CASES[comm.size][0]
    P_x = P_world.create_cartesian_topology_partition(P_shape)
    dims = len(P_shape) - 2
    layer, ref = _layers("Avg", dims, P_x, **kwargs, **avg_kwargs)
    assert_adjoint(layer, random_tensor(scatter(torch.zeros(x_shape), P_x).shape, seed=comm.rank), comm)
    _check(P_x, layer, ref, x_shape, dtype=torch.float32, tol=1e-6, calls=1)
    x = random_tensor(x_shape, seed=4)
    y = layer(scatter(x.bfloat16(), P_x))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), scatter(ref(x), P_x), rtol=2e-2, atol=2e-2)
    integers = (x * 100).long()
    torch.testing.assert_close(layer(scatter(integers, P_x)), scatter(ref(integers), P_x), rtol=0, atol=0)
    layer, ref = _layers("Max", dims, P_x, **kwargs)
    expected = ref(integers.double()).long()  # torch has no integer max_pool1d; distdl's takes them in every dim
    torch.testing.assert_close(layer(scatter(integers, P_x)), scatter(expected, P_x), rtol=0, atol=0)
    x_local = scatter(x, P_x).transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous block
    torch.testing.assert_close(layer(x_local), scatter(ref(x), P_x), rtol=0, atol=0)


@sizes(3)
def test_inactive_workers_and_one_worker(P_world, comm):
    for ranks, P_shape in (([0], (1, 1, 1, 1)), ([1, 2], (1, 1, 1, 2))):
        P_x = P_world.create_partition_inclusive(ranks).create_cartesian_topology_partition(P_shape)
        for kind in ("Max", "Avg"):
            layer, ref = _layers(kind, 2, P_x, kernel_size=3, stride=2, padding=1)
            _check(P_x, layer, ref, (1, 2, 5, 4))
            if not P_x.active:
                assert layer(torch.zeros(0, dtype=torch.float64)).shape == (0,)
                with pytest.raises(ValueError, match=rf"Distributed{kind}Pool2d: worker {comm.rank} is outside P_x"):
                    layer(torch.ones(1, 2, 5, 4, dtype=torch.float64))


@sizes(1, 2)
def test_errors(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    with pytest.raises(ValueError, match=r"DistributedMaxPool2d: expected a partition of 4 dimensions, got shape"):
        pooling.DistributedMaxPool2d(P_x, 2)
    with pytest.raises(ValueError, match=r"DistributedAvgPool1d: expected padding at most half the kernel size "
                                         r"\(3,\), got \(2,\)"):
        pooling.DistributedAvgPool1d(P_x, 3, padding=2)
    with pytest.raises(ValueError, match=r"DistributedMaxPool1d: expected stride as an int or a sequence of 1, "
                                         r"each at least 1"):
        pooling.DistributedMaxPool1d(P_x, 3, stride=(0,))
    for pool in (pooling.DistributedMaxPool1d, pooling.DistributedAvgPool1d):  # 0 is not None (torch rejects it)
        with pytest.raises(ValueError, match=rf"{pool.__name__}: expected stride as an int or a sequence of 1"):
            pool(P_x, 2, stride=0)
    # torch's positions: MaxPool1d(2, 2, 0, 1, True) asks for indices, not ceil_mode
    with pytest.raises(ValueError, match=r"DistributedMaxPool1d: expected return_indices=False"):
        pooling.DistributedMaxPool1d(P_x, 2, 2, 0, 1, True)
    assert pooling.DistributedMaxPool1d(P_x, 2, 2, 0, 1, False, True).ceil_mode
    with pytest.raises(TypeError, match=r"DistributedMaxPool1d: expected a bool for ceil_mode, got 1"):
        pooling.DistributedMaxPool1d(P_x, 3, ceil_mode=1)
    layer = pooling.DistributedAvgPool1d(P_x, 3)
    with pytest.raises(ValueError, match=rf"DistributedAvgPool1d: expected a tensor of 3 dimensions to match P_x of "
                                         rf"shape \(1, 1, {comm.size}\), got shape \(2, 4\) on worker {comm.rank}"):
        layer(torch.ones(2, 4))
    with pytest.raises(TypeError, match="DistributedAvgPool1d: expected a floating-point or int64 tensor, got "
                                        "torch.int32"):
        layer(torch.ones(1, 2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected an input large enough for an output, got global shape"):
        layer(torch.ones(1, 2, 1 if comm.rank == 0 else 0))
    for dtype in (torch.bool, torch.complex64):  # on every worker, before any exchange
        with pytest.raises(TypeError, match=rf"DistributedMaxPool1d: expected a real tensor, got {dtype}"):
            pooling.DistributedMaxPool1d(P_x, 2)(torch.ones(1, 2, 4 if comm.rank == 0 else 0, dtype=dtype))


@sizes(1, 2, 3)
def test_torch_argument_edges(P_world, comm):
    """Arguments torch takes at their edges: an empty stride is the kernel size, a negative divisor_override
    divides by it (both refused until now); a divisor_override that is no non-zero int is refused when the layer is
    built (a tuple passed and failed at the forward with a raw TypeError)."""
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size))
    _check(P_x, *_layers("Max", 1, P_x, kernel_size=3, stride=()), (2, 2, 7))
    P_2 = P_world.create_cartesian_topology_partition((1, 1, comm.size, 1))
    _check(P_2, *_layers("Avg", 2, P_2, kernel_size=2, stride=[], divisor_override=-2), (2, 2, 7, 4))
    for bad in ((3,), 0, True, 2.0):
        with pytest.raises(ValueError, match=rf"DistributedAvgPool1d: expected divisor_override as a non-zero int "
                                             rf"\(or None\), got {re.escape(repr(bad))}"):
            pooling.DistributedAvgPool1d(P_x, 2, divisor_override=bad)


@sizes(1, 2, 3)
def test_max_windows_wholly_in_the_padding(P_world, comm):
    """A dilated window may lie wholly in the padding (kernel 2, dilation 3, padding 1 over 2 pixels): its output
    is -inf, as torch's, and it sends no gradient anywhere (torch's own index points past the input: its backward
    wrote into the next channel's gradient, or past the buffer)."""
    for P_shape, x_shape, kwargs in (((1, 1, 1, comm.size), (2, 3, 2, 4), dict(kernel_size=(2, 1), stride=(3, 1))),
                                     ((1, 1, comm.size), (1, 3, 2), dict(kernel_size=2, stride=3))):
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        dims = len(P_shape) - 2
        layer = getattr(pooling, f"DistributedMaxPool{dims}d")(P_x, padding=1 if dims == 1 else (1, 0),
                                                                 dilation=3 if dims == 1 else (3, 2), **kwargs)
        x = scatter(random_tensor(x_shape, seed=0), P_x).requires_grad_()
        y = layer(x)
        assert y.shape == scatter(torch.zeros(x_shape[:2] + (1,) + x_shape[3:]), P_x).shape
        assert torch.equal(y, torch.full_like(y, -torch.inf))
        y.backward(random_tensor(y.shape, seed=comm.rank))
        assert torch.equal(x.grad, torch.zeros_like(x))


@sizes(1, 2, 3, 4)
def test_max_windows_of_minus_infinity_at_the_edge(P_world, comm):
    """Inputs of -inf at the left edge (a masked_fill before the pool): torch sends a window's gradient to its
    first element inside the input, whatever the worker count (the first worker's window held the padding as
    -inf, which won the tie and dropped the gradient; with dilation, on one worker too)."""
    for P_shape, x_shape, kwargs in (((1, 1, comm.size), (2, 2, 2 * comm.size + 3), dict(kernel_size=3, stride=1)),
                                     # dilated too (its own padding was -inf in the window, on one worker as well)
                                     ((1, 1, comm.size), (1, 2, 2 * comm.size + 4), dict(kernel_size=3, stride=1,
                                                                                          dilation=2)),
                                     ((1, 1, comm.size, 1), (1, 2, 2 * comm.size + 1, 4), dict(kernel_size=3)),
                                     ((1, 1, 1, comm.size), (1, 2, 4, 3 * comm.size), dict(kernel_size=(3, 5),
                                                                                          stride=(1, 2)))):
        P_x = P_world.create_cartesian_topology_partition(P_shape)
        layer, ref = _layers("Max", len(P_shape) - 2, P_x, padding=1, **kwargs)
        x = random_tensor(x_shape, seed=0)
        split = P_shape.index(comm.size) if comm.size > 1 else len(P_shape) - 1
        x.narrow(split, 0, 2).fill_(-torch.inf)  # the first two entries along the split dimension
        _, y = assert_sequential_equivalence(layer, ref, x, P_x, P_x, seed=1)
        assert y.is_contiguous()  # as torch's (the outputs past the block are cropped)


@sizes(1, 2, 3, 4)
def test_windows_inside_the_blocks_exchange_nothing(P_world, comm, monkeypatch):
    """Pooling windows that lie in their workers' blocks (kernel == stride, aligned blocks) skip the exchange."""
    from distdl.nn import _windows
    exchanges = []
    exchange = _windows.window_exchange
    monkeypatch.setattr(_windows, "window_exchange", lambda *args: exchanges.append(1) or exchange(*args))
    P_x = P_world.create_cartesian_topology_partition((1, 1, comm.size, 1))
    # (global shape, kwargs, whether any worker exchanges): aligned blocks; blocks of 5 rows in windows of 4
    # (the window a view of the block on one worker, an exchange on more); windows whose padding torch adds
    # (on the right more than the window has, less than a stride); the width (not split) padded by torch.
    cases = [((2, 3, 4 * comm.size, 6), dict(kernel_size=2), False),
             ((2, 3, 4 * comm.size + 1, 6), dict(kernel_size=2), comm.size > 1),
             ((1, 2, 6 * comm.size, 5), dict(kernel_size=3, stride=3, padding=1), comm.size > 1),
             ((1, 2, 4 * comm.size, 5), dict(kernel_size=(4, 3), padding=(2, 1), stride=(4, 1)), comm.size > 1),
             ((1, 2, 3 * comm.size, 5), dict(kernel_size=(1, 3), padding=(0, 1), stride=1), False)]
    for x_shape, kwargs, exchanged in cases:
        for kind in ("Max", "Avg"):
            _check(P_x, *_layers(kind, 2, P_x, **kwargs), x_shape, calls=1)
            assert bool(exchanges) == exchanged, (x_shape, kwargs, kind)
            exchanges.clear()
