"""torch.compile of a module holding distdl layers: the primitives and the overlapped rings run eagerly between
compiled graphs (Dynamo cannot trace MPI), and values and gradients equal the eager module's."""

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
