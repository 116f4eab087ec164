"""Plans kept per shape stay bounded: a job whose shapes vary every call (sequence lengths, image sizes) must not
keep one plan per shape for ever."""

import torch

from distdl.nn import DistributedAvgPool1d, DistributedConv1d, DistributedUpsample
from distdl.testing import random_tensor, scatter
from helpers import sizes


@sizes(1, 2)
def test_windowed_plans_per_shape_are_bounded(P_world, comm):
    P = P_world.create_cartesian_topology_partition([1, 1, comm.size])
    layers = [DistributedConv1d(P, 1, 1, 3, padding=1), DistributedAvgPool1d(P, 2, padding=1),
              DistributedUpsample(P, scale_factor=2, mode="linear")]
    for n in range(4, 4 + 300):  # a new length every call
        x = scatter(random_tensor((1, 1, n), seed=n, dtype=torch.float32), P).requires_grad_()
        for layer in layers:
            layer(x).sum().backward()
    kept = [len(v) for v in P._cache.values() if isinstance(v, dict)]
    assert len(P._cache) < 20 and max(kept) <= 256, (len(P._cache), kept)


@sizes(2)
def test_iterator_axes_add_no_plan_per_call(P_world, comm):
    from distdl.functional import all_gather, all_sum_reduce, reduce_scatter
    P = P_world.create_cartesian_topology_partition([comm.size, 1])
    x = random_tensor((comm.size, 2), seed=comm.rank)
    for call, name in ((all_sum_reduce, "axes_reduce"), (all_gather, "axes_all_gather"),
                       (reduce_scatter, "axes_reduce_scatter")):
        call(x, P, **{name: (a for a in [0])})
        before = len(P._cache)
        for _ in range(50):  # a new generator object every call, as (a for a in ...) in a training loop
            call(x, P, **{name: (a for a in [0])})
        assert len(P._cache) == before, (call.__name__, before, len(P._cache))
