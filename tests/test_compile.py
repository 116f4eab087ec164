"""torch.compile of a module holding distdl layers: the primitives and the overlapped rings run eagerly between
compiled graphs (Dynamo cannot trace MPI), and values and gradients equal the eager module's."""

import contextlib

import torch

from distdl.nn import (DistributedBatchNorm, DistributedFeatureConv1d, DistributedLinearAllGather,
                       DistributedLinearReduceScatter, DistributedMaxPool1d)
from distdl.testing import random_tensor, scatter
from helpers import sizes


class _Net(torch.nn.Module):
    def __init__(self, P_s, P_f):
        super().__init__()
        self.conv, self.bn = DistributedFeatureConv1d(P_s, 2, 2, 3, padding=1), DistributedBatchNorm(P_s, 2)
        self.pool = DistributedMaxPool1d(P_s, 3, stride=2, padding=1)
        self.up = DistributedLinearAllGather(P_f, 4, 6, overlap=True)
        self.down = DistributedLinearReduceScatter(P_f, 6, 4, overlap=True)

    def forward(self, x, z):
        return self.pool(torch.relu(self.bn(self.conv(x)))), self.down(torch.tanh(self.up(z)))


@sizes(1, 2, 3)
def test_compiled_module_matches_eager(P_world, comm):
    P_s = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    net = _Net(P_s, P_f).double()
    compiled = torch.compile(net, backend="aot_eager")  # inductor would need a C compiler
    for step in range(2):  # the second with a larger batch: recompiled or dynamic
        x = scatter(random_tensor((3 + step, 2, 7), seed=step), P_s)
        z = scatter(random_tensor((3 + step, 4), seed=10 + step), P_f)
        with torch.no_grad():
            dy, dw = (random_tensor(t.shape, seed=20 + comm.rank) for t in net.eval()(x, z))
        results, stats = [], [t.clone() for t in net.bn.buffers()]
        for f in (net.train(), compiled):
            net.zero_grad()
            for t, start in zip(net.bn.buffers(), stats):
                t.copy_(start)
            inputs = [x.clone().requires_grad_(), z.clone().requires_grad_()]
            y, w = f(*inputs)
            torch.autograd.backward([y, w], [dy, dw])
            results.append([y, w, *(t.grad for t in inputs), *(p.grad for p in net.parameters()),
                            net.bn.running_mean.clone()])
        torch.testing.assert_close(results[1], results[0])


@sizes(1, 2, 3)
def test_compiled_autograd_matches_eager(P_world, comm):
    """Under compiled autograd the backward of a gather, a reduce-scatter, a window exchange (pooling) and the
    rings runs its communication eagerly, as torch.compile runs the forward's: Dynamo traced into the adjoints
    (torch's error on a tensor of symbolic size, on some workers only for the pooling)."""
    from torch._dynamo import compiled_autograd
    from distdl.nn import AllGather, ReduceScatter
    P_s = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    P_f = P_world.create_cartesian_topology_partition([1, comm.size])
    layers = [(AllGather(P_f, axes_all_gather=[1]), P_f, (3, 5)), (ReduceScatter(P_f, axes_reduce_scatter=[1]), P_f,
                                                                   (3, 2 * comm.size)),
              (DistributedMaxPool1d(P_s, 3, stride=2, padding=1), P_s, (2, 2, 9)),
              (DistributedLinearAllGather(P_f, 5, 7).double(), P_f, (3, 5)),
              (DistributedLinearReduceScatter(P_f, 7, 5).double(), P_f, (3, 7))]
    for layer, P_x, shape in layers:
        x = scatter(random_tensor(shape, seed=1), P_x)
        results = []
        for compiled in (False, True):
            layer.zero_grad()
            x_k = x.clone().requires_grad_()
            y = layer(x_k)
            dy = random_tensor(y.shape, seed=7 + comm.rank)
            torch._dynamo.reset()
            compiling = compiled_autograd._enable(torch.compile(backend="aot_eager"))
            with compiling if compiled else contextlib.nullcontext():
                y.backward(dy)
            results.append([x_k.grad, *(p.grad for p in layer.parameters())])
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


@sizes(2, 3)
def test_data_parallel_refuses_compiled_autograd(P_world, comm):
    """DataParallel completes its sums in a callback at the end of the backward, which compiled autograd refuses
    (torch's bare AssertionError from queue_callback): NotImplementedError on every worker, naming DataParallel;
    the same model's backward runs as before outside it."""
    from torch._dynamo import compiled_autograd
    from distdl.nn import DataParallel
    torch.manual_seed(0)
    model = DataParallel(torch.nn.Linear(3, 2).double(), P_world)
    x = random_tensor((2, 3), seed=comm.rank)
    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss = model(x).sum()
        try:
            loss.backward()
        except NotImplementedError as error:
            assert str(error).startswith("DataParallel: expected a backward outside compiled autograd")
        else:
            raise AssertionError("no error under compiled autograd")
    model(x).sum().backward()
    xs = torch.cat(comm.allgather(x))
    torch.testing.assert_close(model.module.weight.grad, xs.sum(0).expand(2, 3) / comm.size)
