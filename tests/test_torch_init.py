"""torch's init functions run on every worker, those outside a layer's partition too (`model.apply(init)`); a
parametrized weight is computed once per forward, as in torch's layers."""

import itertools
import warnings

import pytest
import torch

import distdl.nn as dnn
from distdl.testing import random_tensor, scatter
from helpers import sizes

INITS = (torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.kaiming_uniform_,
         torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_)


@sizes(2, 3)
def test_fan_based_inits_work_outside_the_layers_partitions(P_world, comm):
    """Outside its partitions a weight is empty but has a fan (xavier_* divided by zero on (0, 0) weights)."""
    n = comm.size
    first = P_world.create_partition_inclusive(range(n - 1))  # the last worker is in none of the partitions
    P_row = first.create_cartesian_topology_partition((1, n - 1))
    P_one = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    P_image = first.create_cartesian_topology_partition((1, n - 1, 1, 1))
    P_one_image = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1, 1, 1))
    model = torch.nn.ModuleList([
        dnn.DistributedLinear(P_row, P_one, P_one.create_cartesian_topology_partition((1, 1)) if n == 2
                              else P_world.create_partition_inclusive([0, 1]).create_cartesian_topology_partition(
                                  (1, 2)), 12, 16),
        dnn.DistributedLinearAllGather(P_row, 12, 16), dnn.DistributedLinearReduceScatter(P_row, 12, 16),
        dnn.DistributedEmbedding(P_row, 10, 6),
        dnn.DistributedChannelConv2d(P_image, P_one_image, P_image.create_cartesian_topology_partition(
            (1, n - 1, 1, 1)), 4, 6, 3),
        dnn.DistributedLayerNorm(P_image.create_cartesian_topology_partition((1, 1, n - 1, 1)), (5, 4))])
    for layer in model:
        weight = layer.weight
        assert weight.dim() >= 2 and weight.shape[1] > 0, (type(layer).__name__, tuple(weight.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: initialising an empty tensor is a no-op
        for init in INITS:
            model.apply(lambda m: init(m.weight) if getattr(m, "weight", None) is not None and m.weight.dim() >= 2
                        else None)


class _Counted(torch.nn.Module):
    """An identity parametrization that counts its evaluations."""
    calls = 0

    def forward(self, w):
        _Counted.calls += 1
        return w


@sizes(1, 2, 3)
@pytest.mark.parametrize("kind", ["linear", "feature conv", "channel conv", "batch norm", "all-gather linear",
                                  "reduce-scatter linear", "layer norm"])
def test_a_parametrized_weight_is_computed_once_per_forward(P_world, comm, kind):
    """The input's dtype check read the weight (a test the bias) before the forward read it again: a
    parametrization ran twice per forward (spectral_norm's power iteration two steps, so u and the gradients drifted
    from torch's)."""
    n = comm.size
    P_one = P_world.create_partition_inclusive([0])
    P_row, P_image = (P_world.create_cartesian_topology_partition(s) for s in ((1, n), (1, 1, n)))
    P_channels = P_world.create_cartesian_topology_partition((1, n, 1))
    layers = {"linear": (lambda: dnn.DistributedLinear(P_row, P_one.create_cartesian_topology_partition((1, 1)),
                                                       P_row, 7, 5), torch.nn.Linear(7, 5), (3, 7), P_row),
              "feature conv": (lambda: dnn.DistributedConv1d(P_image, 3, 4, 3, padding=1), torch.nn.Conv1d(3, 4, 3),
                               (2, 3, 7), P_image),
              "channel conv": (lambda: dnn.DistributedConv1d(P_channels, P_one.create_cartesian_topology_partition(
                  (1, 1, 1)), P_channels, 5, 3, 3), torch.nn.Conv1d(5, 3, 3), (2, 5, 6), P_channels),
              "batch norm": (lambda: dnn.DistributedBatchNorm(P_image, 3), torch.nn.BatchNorm1d(3), (2, 3, 7),
                             P_image),
              "all-gather linear": (lambda: dnn.DistributedLinearAllGather(P_row, 7, 5), torch.nn.Linear(7, 5),
                                    (3, 7), P_row),
              "reduce-scatter linear": (lambda: dnn.DistributedLinearReduceScatter(P_row, 7, 5),
                                        torch.nn.Linear(7, 5), (3, 7), P_row),
              "layer norm": (lambda: dnn.DistributedLayerNorm(P_row, 7), torch.nn.LayerNorm(7), (3, 7), P_row)}
    make, sequential, shape, P_x = layers[kind]
    layer = make()
    for module in (layer, sequential):
        for name in ("weight", "bias"):
            if getattr(module, name) is not None:  # a bias on some workers of the layer only
                torch.nn.utils.parametrize.register_parametrization(module, name, _Counted())
    x = random_tensor(shape, seed=1, dtype=torch.float32)
    _Counted.calls = 0
    sequential(x)
    expected, _Counted.calls = _Counted.calls, 0
    layer(scatter(x, P_x))
    assert expected == 2 and _Counted.calls == len(layer.parametrizations), kind


@sizes(1, 2, 3)
@pytest.mark.parametrize("how", ["device argument", "device context"])
def test_deferred_initialisation_on_the_meta_device(P_world, comm, how):
    """Built on the meta device (torch's deferred initialisation), then to_empty() and reset_parameters() from the
    same seed, every layer holds what it holds built directly. The seed was drawn on the default device (no
    values on meta: torch's error under `with torch.device("meta")`), the feature convolution broadcast its meta
    parameters (mpi4py's "expecting non-NULL address"), and a forward on meta tensors failed inside torch. A layer
    not materialised is refused with TypeError, and so is DataParallel of one."""
    n = comm.size
    P_one = P_world.create_partition_inclusive([0])
    P_row, P_image = (P_world.create_cartesian_topology_partition(s) for s in ((1, n), (1, 1, n)))
    P_channels = P_world.create_cartesian_topology_partition((1, n, 1))
    P_column = P_world.create_cartesian_topology_partition((n, 1))
    builders = [lambda **f: dnn.DistributedLinear(P_row, P_one.create_cartesian_topology_partition((1, 1)), P_row,
                                                  7, 5, **f),
                # the last worker's blocks are empty (it went on into the broadcast while the others raised)
                lambda **f: dnn.DistributedLinear(P_one.create_cartesian_topology_partition((1, 1)), P_row, P_column,
                                                  4, max(n - 1, 1), **f),
                lambda **f: dnn.DistributedLinearAllGather(P_row, 7, 5, **f),
                lambda **f: dnn.DistributedLinearReduceScatter(P_row, 7, 5, **f),
                lambda **f: dnn.DistributedEmbedding(P_row, 9, 6, **f),
                lambda **f: dnn.DistributedConv1d(P_image, 3, 4, 3, **f),
                lambda **f: dnn.DistributedConv1d(P_channels, P_one.create_cartesian_topology_partition((1, 1, 1)),
                                                  P_channels, 5, 3, 3, **f),
                lambda **f: dnn.DistributedBatchNorm(P_image, 3, **f),
                lambda **f: dnn.DistributedLayerNorm(P_image, (3, 4), **f)]
    for build in builders:
        torch.manual_seed(1)
        expected = build()
        if how == "device argument":
            layer = build(device="meta")
        else:
            with torch.device("meta"):
                layer = build()
        assert all(t.is_meta for t in layer.state_dict().values())
        # not materialised: refused on every worker, naming the layer (torch's errors on some workers, or a meta
        # output), before any input check or communication
        with pytest.raises(TypeError, match=f"{type(layer).__name__}: expected parameters and buffers with values, "
                                            "got weight on the meta device"):
            layer(torch.zeros(1))
        with pytest.raises(TypeError, match="DataParallel: expected parameters and buffers with values"):
            dnn.DataParallel(layer, P_world)
        layer.to_empty(device="cpu")
        torch.manual_seed(1)
        layer.reset_parameters()
        for key, value in expected.state_dict().items():
            torch.testing.assert_close(layer.state_dict()[key], value, rtol=0, atol=0, msg=key)
        if isinstance(layer, dnn.DistributedLinearAllGather):  # a meta input
            x = torch.empty(3, 7 // n + (comm.rank < 7 % n), device="meta")
            with pytest.raises(TypeError, match="DistributedLinearAllGather: expected a tensor with values .MPI "
                                                "moves them., got one on the meta device"):
                layer(x)


@sizes(1, 2, 3)
def test_a_meta_layer_loads_a_collected_state_with_assign(P_world, comm):
    """torch's deferred initialisation: built on the meta device, then load_state_dict(rank 0's dict, assign=True).
    The workers of the layer take their blocks; the last worker, outside it, kept its meta tensors (empty ones for a
    linear, whole ones for a feature convolution) and alone refused the forward, while the others went on (a hang
    where caught)."""
    from distdl.testing import assert_sequential_equivalence
    k = max(1, comm.size - 1)  # the last worker is outside the layers where there are two or more
    P_k = P_world.create_partition_inclusive(range(k))
    P_x, P_w = (P_k.create_cartesian_topology_partition((1, k)) for _ in range(2))
    P_y = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition((1, 1))
    P_image = P_k.create_cartesian_topology_partition((1, 1, k))
    torch.manual_seed(0)
    cases = [(dnn.DistributedLinear(P_x, P_y, P_w, 5, 3, collect_state=True, device="meta", dtype=torch.float64),
              torch.nn.Linear(5, 3).double(), (2, 5), P_x, P_y),
             (dnn.DistributedConv1d(P_image, 3, 4, 3, padding=1, collect_state=True, device="meta",
                                    dtype=torch.float64), torch.nn.Conv1d(3, 4, 3, padding=1).double(), (2, 3, 2 * k),
              P_image, P_image)]
    for layer, ref, shape, P_in, P_out in cases:
        result = layer.load_state_dict(ref.state_dict() if comm.rank == 0 else {}, assign=True)
        assert not result.missing_keys and not result.unexpected_keys
        assert not any(t.is_meta for t in itertools.chain(layer.parameters(), layer.buffers()))
        assert_sequential_equivalence(layer, ref, random_tensor(shape, seed=3, dtype=torch.float64), P_in, P_out)
