"""DistributedGeneralConv1d/2d/3d: convolution of a tensor partitioned along channels, space and batch.

Forward ``y = SumReduce(P_w -> P_y)(conv(Broadcast(P_x -> P_w)(window(x)), W_ij) + [j == 0] b_i)``: each worker
of ``P_x`` first fetches the input window its output block reads (``window_exchange``, as
:mod:`~distdl.nn.conv_feature`: halos of any width, zeros past the edges), then the channels are mixed as in
:mod:`~distdl.nn.conv_channel`. Accepted layouts (``P_s`` the spatial partition, ``d`` extents):

- DistDL's: ``P_x`` (1, P_ci, *P_s), ``P_y`` (1, P_co, *P_s), ``P_w`` (P_co, P_ci, *P_s);
- with a split batch: ``P_x`` (P_b, P_ci, *P_s), ``P_y`` (P_b, P_co, *P_s), ``P_w`` (P_b, P_co, P_ci, *P_s).

Worker ``(b, i, j, s)`` of ``P_w`` convolves input channel block ``j`` of batch block ``b`` and spatial block
``s`` with ``W[out_block_i, in_block_j]``. Weight blocks are replicated along ``P_w``'s batch and spatial axes
and enter through ``all_sum_reduce_backward`` (their gradients are the totals, so the copies stay equal); the
bias block lives where ``j == 0``. For the broadcast ``P_x`` is seen as (P_b, 1, P_ci, *P_s) (split batch only)
and for the sum ``P_y`` as (P_co, 1, *P_s) or (P_b, P_co, 1, *P_s). Only ``padding_mode='zeros'``.

==========================  =================================================================
worker                      does
==========================  =================================================================
in P_x                      fetches its window, sends it to the workers of ``P_w`` in its fibre
in P_w                      convolves the window it receives with its weight block
in P_y                      receives the sum over the input-channel blocks
in none of them             passes and gets a zero-volume tensor; holds zero-volume parameters
==========================  =================================================================

A malformed global decomposition of ``x`` is found by the workers of ``P_x`` (one allgather); workers outside
``P_x`` cannot see it, and distdl's abort-on-error ends the job.
"""

from __future__ import annotations

import torch

from distdl.nn import _windows
from distdl.nn.conv_channel import _BlockConvNd, regrid
from distdl.partition import MPIPartition

__all__ = ["DistributedGeneralConv1d", "DistributedGeneralConv2d", "DistributedGeneralConv3d"]


class _DistributedGeneralConvNd(_BlockConvNd):
    """Convolve ``(N, C, *spatial)`` tensors split along any of channels, spatial dimensions and batch.

    Args:
        P_x, P_y, P_w: the partitions of the input, output and weight, in one of the layouts of
            :mod:`distdl.nn.conv_general` (``P_w`` of ``d + 2`` dimensions, or ``d + 3`` with a batch axis first).
        in_channels, out_channels: the GLOBAL channel counts, ints or NumPy integers (balanced blocks, unevenly if
            need be).
        collect_state: ``state_dict()`` on rank 0 of the root partition holds torch's keys and global shapes,
            and ``load_state_dict()`` takes that rank's values (see :mod:`distdl.nn.module`).
        The other arguments are torch's; ``padding`` may be ``'same'`` or ``'valid'``; ``groups`` must be 1.
    Raises:
        ValueError: partitions of the wrong shapes, ``groups != 1``, a ``padding_mode`` other than ``'zeros'``,
            or arguments torch would reject.
        TypeError: arguments of the wrong types.
    """

    padding_modes = ("zeros",)

    def _layout(self, name: str, P_x: MPIPartition, P_y: MPIPartition, P_w: MPIPartition):
        d = self.dims
        batch = P_w.dim == d + 3
        P_b, P_co, P_ci = ((1,) + P_w.shape[:P_w.dim - d])[-3:] if P_w.dim in (d + 2, d + 3) else (0, 0, 0)
        P_s = P_w.shape[P_w.dim - d:]
        if P_b == 0 or P_x.shape != (P_b, P_ci) + P_s or P_y.shape != (P_b, P_co) + P_s:
            raise ValueError(f"{name}: expected P_w of shape (P_co, P_ci, *P_s) with P_x of shape (1, P_ci, *P_s) and "
                             f"P_y of shape (1, P_co, *P_s), or P_w of shape (P_b, P_co, P_ci, *P_s) with P_x of shape "
                             f"(P_b, P_ci, *P_s) and P_y of shape (P_b, P_co, *P_s), {d} spatial axes in P_s; got "
                             f"P_x {P_x.shape}, P_y {P_y.shape} and P_w {P_w.shape}")
        if batch:
            return (regrid(P_x, (P_b, 1, P_ci) + P_s), P_w, regrid(P_y, (P_b, P_co, 1) + P_s), (1, 2))
        return P_x, P_w, regrid(P_y, (P_co, 1) + P_s), (0, 1)

    def _length(self, k: int, n: int) -> int:
        return _windows.sliding_length(n, self.kernel_size[k], self.stride[k], *self._pads[k], self.dilation[k])

    def _source(self, k: int, n: int, length: int, o0: int, o1: int) -> tuple[int, int]:
        return _windows.sliding_source(o0, o1, self.kernel_size[k], self.stride[k], self._pads[k][0],
                                       self.dilation[k])

    def _window(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Return the input window this worker's output block reads (collective over ``P_x``)."""
        if not self.P_x.active:
            return x
        key = ("conv", self.kernel_size, self.stride, self._pads, self.dilation, self.out_channels)
        return _windows.fetch(name, x, self.P_x, key, self.out_channels, self._length, self._source)[1]

    def _local_pads(self) -> tuple[tuple[int, int], ...]:
        return ((0, 0),) * self.dims  # the window holds the padding


class DistributedGeneralConv1d(_DistributedGeneralConvNd):
    """Convolve ``(N, C, L)`` tensors partitioned along channels, length and batch."""
    dims = 1


class DistributedGeneralConv2d(_DistributedGeneralConvNd):
    """Convolve ``(N, C, H, W)`` tensors partitioned along channels, height, width and batch."""
    dims = 2


class DistributedGeneralConv3d(_DistributedGeneralConvNd):
    """Convolve ``(N, C, D, H, W)`` tensors partitioned along channels, the spatial dimensions and batch."""
    dims = 3
