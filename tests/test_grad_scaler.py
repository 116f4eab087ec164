"""GradScaler: torch's gradient scaler with its overflow check agreed over the model's workers."""

import pytest
import torch

from distdl.nn import DistributedLinear, DistributedLinearAllGather, GradScaler, clip_grad_norm_
from distdl.testing import random_tensor, scatter
from distdl.utilities.torch import zero_volume_tensor
from helpers import sizes


@sizes(1, 2, 3, 4)
@pytest.mark.parametrize("fused", [False, True])
def test_an_overflow_in_one_block_skips_the_step_everywhere(P_world, comm, fused):
    """A tensor-parallel linear layer whose last output feature's gradient overflows once scaled (at the first step
    only): on the worker holding it alone with torch's scaler. Every worker skips that step and halves its scale,
    as the sequential model does, and the clipped steps after it equal torch's (torch's scaler stepped the others,
    with NaN gradients after clip_grad_norm_). A fused Adam checks without unscale_: agreed all the same."""
    shape = [2, 2] if comm.size == 4 else [1, comm.size]  # at 4, a batch axis too
    P = P_world.create_cartesian_topology_partition(shape)
    torch.manual_seed(5)
    model = DistributedLinearAllGather(P, 4, 6, collect_state=True)
    sequential = torch.nn.Linear(4, 6)
    sequential.load_state_dict(comm.bcast(model.state_dict(), root=0))
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1, fused=True) if fused else
                  torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, sequential)]
    scalers = [GradScaler(P_world, "cpu", init_scale=2.0 ** 10), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)]
    for step in range(3):
        x, cotangent = random_tensor((4, 4), seed=10 + step).float(), random_tensor((4, 6), seed=20 + step).float()
        if step == 0:
            cotangent[:, 5] = 1e37  # finite; times the scale, inf in float32
        for m, optimizer, scaler, split in zip((model, sequential), optimizers, scalers, (True, False)):
            optimizer.zero_grad()
            loss = (m(scatter(x, P) if split else x) * (scatter(cotangent, P) if split else cotangent)).sum()
            scaler.scale(loss).backward()
            if not fused:
                scaler.unscale_(optimizer)
                clip_grad_norm_(m, 1.0, P) if split else torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** 9, step  # halved once, at the first
        state = comm.bcast(model.state_dict(), root=0)
        for key, value in sequential.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"{key} at step {step}")
        assert all(bool(p.isfinite().all()) for p in model.parameters())


@sizes(2, 3)
def test_workers_without_gradients_step(P_world, comm):
    """A layer on rank 0 alone: the other workers' parameters are zero-volume and get no gradient; torch's scaler
    raised "No inf checks were recorded for this optimizer" there. Every worker steps (or skips) as rank 0."""
    P_0 = P_world.create_partition_inclusive([0]).create_cartesian_topology_partition([1, 1])
    torch.manual_seed(2)
    layer = DistributedLinear(P_0, P_0, P_0, 4, 3)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = GradScaler(P_world, "cpu", init_scale=2.0 ** 10)
    for step, overflow in enumerate((False, True)):
        x = random_tensor((2, 4), seed=step).float()
        if overflow:
            x[0, 0] = 1e37
        before = [p.detach().clone() for p in layer.parameters()]
        y = layer(x if P_0.active else zero_volume_tensor(dtype=torch.float32))
        loss = y.sum() if P_0.active else y.square().sum()  # a worker outside takes part in the backward
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        assert scaler.get_scale() == (2.0 ** 10 if not overflow else 2.0 ** 9)
        if P_0.active:
            assert all(torch.equal(p, b) == overflow for p, b in zip(layer.parameters(), before))
