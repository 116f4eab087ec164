"""DistributedGeneralConv1d/2d/3d and the DistributedConv factory: forward, input and parameter gradients equal
torch's on the gathered tensors."""

import numpy as np
import pytest
import torch

from distdl.nn.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d
from distdl.nn.conv_channel import DistributedChannelConv1d, DistributedChannelConv2d
from distdl.nn.conv_feature import DistributedFeatureConv3d
from distdl.nn.conv_general import DistributedGeneralConv1d, DistributedGeneralConv2d, DistributedGeneralConv3d
from distdl.testing import assert_adjoint, gather, random_tensor, scatter
from helpers import sizes
from test_conv_channel import check, make_pair, numpy_counts, partitions

SELECTORS = {1: DistributedConv1d, 2: DistributedConv2d, 3: DistributedConv3d}
LAYERS = {1: (DistributedGeneralConv1d, torch.nn.Conv1d), 2: (DistributedGeneralConv2d, torch.nn.Conv2d),
          3: (DistributedGeneralConv3d, torch.nn.Conv3d)}

# (P_w shape, root ranks of P_x, P_w and P_y, global input shape, out_channels, kwargs). P_w has d + 2 axes
# (P_co, P_ci, *P_s) or d + 3 (P_b, P_co, P_ci, *P_s). Spatial-only, channel-only and batch-only splits, and
# channels with space, batch with space, batch with channels; uneven splits, halos wider than blocks, empty
# output blocks, partitions on different workers in different orders.
CASES = {
    1: [((1, 1, 1, 1), [0], [0], [0], (2, 3, 5, 4), 2, dict(kernel_size=3, padding=1))],
    2: [((1, 1, 2), [0, 1], [0, 1], [0, 1], (2, 3, 9), 2, dict(kernel_size=3, padding=1)),
        ((1, 2, 1, 1), [0, 1], [1, 0], [1], (1, 5, 5, 4), 3, dict(kernel_size=3, padding="same")),
        ((2, 1, 1, 1), [0, 1], [1, 0], [1, 0], (3, 2, 7), 3, dict(kernel_size=2, stride=2))],
    3: [((1, 1, 3), [0, 1, 2], [0, 1, 2], [0, 1, 2], (2, 2, 5), 3, dict(kernel_size=5, padding=2)),
        ((3, 1, 1, 1), [1], [0, 1, 2], [2, 0, 1], (1, 2, 4, 4), 5, dict(kernel_size=3, stride=2, padding=1)),
        ((1, 1, 3), [0, 1, 2], [2, 0, 1], [1, 2, 0], (1, 2, 8), 2, dict(kernel_size=3, stride=4))],
    4: [((2, 1, 2), [0, 1], [0, 1, 2, 3], [2, 3, 0, 1], (2, 3, 7), 5, dict(kernel_size=3, padding=1)),
        ((1, 2, 1, 2), [0, 1, 2, 3], [3, 2, 1, 0], [0, 1], (1, 5, 4, 6), 3,
         dict(kernel_size=(3, 2), dilation=(1, 2), padding=(1, 1))),
        ((2, 1, 1, 2), [0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1], (3, 2, 9), 2, dict(kernel_size=3, padding="same")),
        ((1, 2, 2, 1), [0, 1], [0, 1, 2, 3], [2, 3], (2, 3, 6), 3, dict(kernel_size=3, bias=False)),
        ((2, 1, 2, 1), [0, 1, 2, 3], [0, 1, 2, 3], [3, 1], (3, 3, 5), 2, dict(kernel_size=2)),
        ((1, 1, 1, 2, 2), [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], (1, 2, 3, 4, 5), 2,
         dict(kernel_size=3, padding=(0, 1, 2), stride=(1, 2, 1)))],
}


def general_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks, dims):
    """``P_x``, ``P_y``, ``P_w`` and the axes of ``P_w`` holding output and input channels."""
    P_b, P_co, P_ci = ((1,) + tuple(P_w_shape[:len(P_w_shape) - dims]))[-3:]
    P_s = tuple(P_w_shape[len(P_w_shape) - dims:])
    axes = (0, 1) if len(P_w_shape) == dims + 2 else (1, 2)
    return (*partitions(P_world, (P_b, P_ci) + P_s, (P_b, P_co) + P_s, P_w_shape, x_ranks, w_ranks, y_ranks), axes)


def _case(P_world, case):
    P_w_shape, x_ranks, w_ranks, y_ranks, x_shape, out_channels, kwargs = case
    return general_partitions(P_world, P_w_shape, x_ranks, w_ranks, y_ranks, len(x_shape) - 2), x_shape, \
        out_channels, kwargs


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_matches_torch(P_world, comm):
    for case in CASES[comm.size]:
        (P_x, P_y, P_w, axes), x_shape, out_channels, kwargs = _case(P_world, case)
        layer, ref = make_pair(LAYERS, P_x, P_y, P_w, axes, x_shape, out_channels, **kwargs)
        check(layer, ref, P_x, P_y, P_w, axes, x_shape)
        if P_w.active:  # the copies of a block along P_w's batch and spatial axes hold equal values
            copies = P_w.create_subpartition([a for a in range(P_w.dim) if a not in axes])
            gathered = copies.allgather_data(layer.weight.detach().numpy())
            assert (gathered == gathered[0]).all()


@sizes(1, 2, 3, 4)
def test_adjoint_float32_and_non_contiguous(P_world, comm):
    (P_x, P_y, P_w, axes), x_shape, out_channels, kwargs = _case(P_world, CASES[comm.size][-1])
    layer, _ = make_pair(LAYERS, P_x, P_y, P_w, axes, x_shape, out_channels, **{**kwargs, "bias": False})
    assert_adjoint(layer, random_tensor(scatter(torch.zeros(x_shape), P_x).shape, seed=comm.rank), comm)
    layer, ref = make_pair(LAYERS, P_x, P_y, P_w, axes, x_shape, out_channels, dtype=torch.float32, **kwargs)
    check(layer, ref, P_x, P_y, P_w, axes, x_shape, dtype=torch.float32, tol=1e-5, calls=1)
    x = random_tensor(x_shape, seed=3, dtype=torch.float32)
    x_local = scatter(x, P_x)
    if P_x.active:
        x_local = x_local.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous block
    with torch.no_grad():
        torch.testing.assert_close(layer(x_local), scatter(ref(x), P_y), rtol=1e-5, atol=1e-5)


@sizes(4)
def test_every_worker_runs_backward(P_world, comm):
    """With the input on workers apart from the weights and no input gradient wanted (a first layer), every
    worker still takes part in backward and the (replicated) weight gradients are torch's."""
    P_x, P_y, P_w = partitions(P_world, (1, 1, 2), (1, 1, 2), (1, 1, 2), [0, 1], [2, 3], [3, 0])
    layer, ref = make_pair(LAYERS, P_x, P_y, P_w, (0, 1), (2, 3, 7), 2, kernel_size=3, padding=2)
    x, dy = random_tensor((2, 3, 7), seed=1), random_tensor((2, 2, 9), seed=2)
    y = layer(scatter(x, P_x))
    y.backward(scatter(dy, P_y) if P_y.active else torch.zeros_like(y))
    ref(x).backward(dy)
    if P_w.active:
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-12, atol=1e-12)


@sizes(1, 4)
def test_state_dict_round_trip(P_world, comm):
    (P_x, P_y, P_w, axes), x_shape, out_channels, kwargs = _case(P_world, CASES[comm.size][-2 if comm.size > 1 else 0])
    plain, ref = make_pair(LAYERS, P_x, P_y, P_w, axes, x_shape, out_channels, **kwargs)
    layer = type(plain)(P_x, P_y, P_w, x_shape[1], out_channels, collect_state=True, **kwargs).double()
    layer.load_state_dict(ref.state_dict() if P_w.rank == 0 else {})
    check(layer, ref, P_x, P_y, P_w, axes, x_shape, calls=1)
    state = layer.state_dict()
    if P_w.rank == 0:
        assert list(state) == ["weight", "bias"]
        for key, value in ref.state_dict().items():
            assert torch.equal(state[key], value)
    else:
        assert list(state) == []


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(4)
def test_factory(P_world, comm):
    P_x = P_world.create_cartesian_topology_partition((1, 1, 1, 2, 2))
    assert isinstance(DistributedConv3d(P_x, 2, 3, 3), DistributedFeatureConv3d)
    P_x, P_y, P_w = partitions(P_world, (1, 2, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), [0, 1], [0, 1, 2, 3], [2, 3])
    assert isinstance(DistributedConv2d(P_x, 3, 4, 3, P_y=P_y, P_w=P_w), DistributedChannelConv2d)
    (P_x, P_y, P_w, axes), x_shape, out_channels, kwargs = _case(P_world, CASES[4][0])
    layer = DistributedConv1d(P_x, x_shape[1], out_channels, P_y=P_y, P_w=P_w, **kwargs)
    assert isinstance(layer, DistributedGeneralConv1d)
    P_x, P_y, P_w = partitions(P_world, (2, 1, 1), (2, 1, 1), (2, 1, 1, 1), [0, 1], [0, 1], [0, 1])
    assert isinstance(DistributedConv1d(P_x, 2, 2, 3, P_y=P_y, P_w=P_w), DistributedGeneralConv1d)
    P_1 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1))
    assert isinstance(DistributedConv1d(P_1, 2, 2, 3, P_y=P_1, P_w=P_1), DistributedChannelConv1d)
    with pytest.raises(ValueError, match=r"DistributedConv2d: expected both P_y and P_w or neither, got P_w alone"):
        DistributedConv2d(P_x, 2, 2, 3, P_w=P_w)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@sizes(1, 2, 3, 4)
def test_factory_takes_distdl_positional_partitions(P_world, comm):
    """DistDL's ``DistributedConv2d(P_x, P_y, P_w, in_channels, ...)``, with NumPy channel counts, builds the layer
    for the partitions (channel or general), which matches torch and is an instance of the factory's class."""
    for case in CASES[comm.size]:
        (P_x, P_y, P_w, axes), x_shape, out_channels, kwargs = _case(P_world, case)
        dims = len(x_shape) - 2
        layers = {dims: (numpy_counts(SELECTORS[dims]), LAYERS[dims][1])}
        layer, ref = make_pair(layers, P_x, P_y, P_w, axes, x_shape, out_channels, **kwargs)
        kind = "Channel" if P_w.dim == dims + 2 and P_w.shape[2:] == (1,) * dims else "General"
        assert type(layer).__name__ == f"Distributed{kind}Conv{dims}d"
        assert isinstance(layer, SELECTORS[dims]) and not isinstance(ref, SELECTORS[dims])
        assert not any(isinstance(layer, SELECTORS[d]) for d in SELECTORS if d != dims)
        assert type(layer.in_channels) is int and type(layer.out_channels) is int
        check(layer, ref, P_x, P_y, P_w, axes, x_shape)


@sizes(1, 2)
def test_factory_call_forms(P_world, comm):
    """The partitions by position, by keyword or mixed; keyword channel counts; the errors name the factory."""
    n = comm.size
    P_x, P_y, P_w = partitions(P_world, (1, n, 1), (1, 1, 1), (1, n, 1), list(range(n)), list(range(n)), [0])
    for layer in (DistributedConv1d(P_x, P_y, P_w, 4, 2, 3), DistributedConv1d(P_x, P_y, 4, 2, 3, P_w=P_w),
                  DistributedConv1d(P_x, 4, 2, 3, P_y=P_y, P_w=P_w),
                  DistributedConv1d(P_x, P_y, P_w, in_channels=4, out_channels=2, kernel_size=3)):
        assert type(layer) is DistributedChannelConv1d and isinstance(layer, DistributedConv1d)
        assert (layer.in_channels, layer.out_channels, layer.kernel_size) == (4, 2, (3,))
    P_s = P_world.create_cartesian_topology_partition((1, 1, n))
    layer = DistributedConv1d(P_s, in_channels=2, out_channels=3, kernel_size=3)
    assert isinstance(layer, DistributedConv1d) and not isinstance(layer, DistributedConv2d)
    assert not isinstance(torch.nn.Conv1d(2, 3, 3), DistributedConv1d) and not isinstance(3, DistributedConv1d)
    assert issubclass(DistributedGeneralConv2d, DistributedConv2d) and issubclass(DistributedConv2d, DistributedConv2d)
    assert not issubclass(DistributedGeneralConv2d, DistributedConv1d) and not issubclass(torch.nn.Conv2d,
                                                                                           DistributedConv2d)
    with pytest.raises(ValueError, match=r"DistributedConv1d: expected both P_y and P_w or neither, got P_y alone"):
        DistributedConv1d(P_x, P_y, 4, 2, 3)
    with pytest.raises(TypeError, match=r"DistributedConv1d: got P_y both by position and by keyword"):
        DistributedConv1d(P_x, P_y, P_w, 4, 2, 3, P_y=P_y)
    with pytest.raises(TypeError, match=r"DistributedConv2d: expected an MPIPartition for P_x, got int"):
        DistributedConv2d(3, P_y, P_w, 4, 2, 3)
    with pytest.raises(ValueError, match=r"DistributedChannelConv1d: expected a positive int for in_channels, got "
                                         r"np.float64\(4.0\)"):
        DistributedConv1d(P_x, P_y, P_w, np.float64(4.0), 2, 3)


@sizes(1, 2)
def test_errors(P_world, comm):
    n = comm.size
    P_x, P_y, P_w = partitions(P_world, (1, 1, n), (1, 1, n), (1, 1, n), list(range(n)), list(range(n)), list(range(n)))
    with pytest.raises(ValueError, match=r"DistributedGeneralConv1d: expected P_w of shape \(P_co, P_ci, \*P_s\) with "
                                         r"P_x of shape \(1, P_ci, \*P_s\) and P_y of shape \(1, P_co, \*P_s\), or P_w "
                                         r"of shape \(P_b, P_co, P_ci, \*P_s\) with P_x of shape \(P_b, P_ci, \*P_s\) "
                                         rf"and P_y of shape \(P_b, P_co, \*P_s\), 1 spatial axes in P_s; got P_x "
                                         rf"\(1, 1, {n}\), P_y \(1, 1, {n}\) and P_w \({n},\)"):
        DistributedGeneralConv1d(P_x, P_y, P_world, 2, 2, 3)
    with pytest.raises(ValueError, match=r"got P_x \(1, 1, \d\), P_y \(1, 1, \d\) and P_w \(1, 1, 1, \d\)"):
        DistributedGeneralConv2d(P_x, P_y, P_world.create_cartesian_topology_partition((1, 1, 1, n)), 2, 2, 3)
    with pytest.raises(ValueError, match=r"DistributedGeneralConv1d: expected padding_mode in \['zeros'\], got "
                                         r"'reflect'"):
        DistributedGeneralConv1d(P_x, P_y, P_w, 2, 2, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match=r"DistributedGeneralConv1d: expected groups=1"):
        DistributedGeneralConv1d(P_x, P_y, P_w, 2, 2, 3, groups=2)
    with pytest.raises(ValueError, match=r"expected stride 1 with padding='same'"):
        DistributedGeneralConv1d(P_x, P_y, P_w, 2, 2, 3, stride=2, padding="same")
    layer = DistributedGeneralConv1d(P_x, P_y, P_w, 2, 3, 3).double()
    with pytest.raises(ValueError, match=r"DistributedGeneralConv1d: expected 2 channels \(dimension 1: this worker's "
                                         rf"block of 2 over P_x of shape \(1, 1, {n}\)\), got shape \(1, 3, 4\) on "
                                         rf"worker {comm.rank}"):
        layer(torch.ones(1, 3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected a tensor of dtype torch.float64"):
        layer(torch.ones(1, 2, 4))
    # Every worker of P_x learns the global shape, so every worker raises the same error.
    with pytest.raises(ValueError, match=r"expected an input large enough for an output, got global shape"):
        layer(torch.ones(1, 2, 1 if comm.rank == 0 else 0, dtype=torch.float64))


@sizes(2, 3)
@pytest.mark.parametrize("autocast", [False, True])
def test_bfloat16_3d_windows_with_a_stride(P_world, comm, autocast):
    """A strided 3-d convolution in bfloat16 (or under CPU autocast) whose windows are a few elements wide: torch's
    CPU kernel gave values up to the dtype's range there (torch 2.13; not on the whole, padded tensor), so both
    layers' outputs were garbage. distdl runs such convolutions in float32 and rounds."""
    P_x = P_world.create_cartesian_topology_partition((1, 1, 1, 1, comm.size))
    kw = {"kernel_size": (2, 1, 2), "stride": (2, 1, 2), "padding": (3, 3, 2), "bias": False}
    weight, x_global = random_tensor((2, 1, 2, 1, 2), seed=1), random_tensor((3, 1, 5, 5, 3), seed=0)
    dtype = torch.float32 if autocast else torch.bfloat16
    expected = torch.nn.functional.conv3d(x_global, weight, None, kw["stride"], kw["padding"])
    for layer in (DistributedGeneralConv3d(P_x, P_x, P_x, 1, 2, **kw), DistributedFeatureConv3d(P_x, 1, 2, **kw)):
        with torch.no_grad():
            layer.weight.copy_(weight)
        layer.to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(scatter(x_global.to(dtype), P_x))
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(gather(y.detach(), P_x).double(), expected, atol=0.05, rtol=0.02)
