"""DistributedEmbedding: an embedding table whose embedding dimension is split over the last partition axis.

Forward ``y[..., :] = table[x[...], emb_block_m]`` on the worker at coordinate ``m`` of the last axis of
``P_x``: the output ``(..., embedding_dim)`` is partitioned by ``P_x``, whose last axis splits the embedding
dimension; the indices ``x`` (one dimension fewer) are partitioned over the leading axes of ``P_x`` and
replicated along the last one. No communication in forward; the table block is replicated over the
leading (data) axes, so its gradient is summed over them (``all_sum_reduce_backward``).

==========================  =================================================================
worker                      does
==========================  =================================================================
in P_x                      looks its indices up in its columns of the table
outside P_x                 passes and gets a zero-volume tensor; holds a zero-volume table
==========================  =================================================================
"""

from __future__ import annotations

import numbers

import torch

from distdl.checks import announce, check_mode, checksum, verify
from distdl.functional._common import check_flags, check_idle_input, check_partition, check_tensor
from distdl.functional.all_sum_reduce import fibre
from distdl.nn.linear import SeededInit, check_features
from distdl.nn.linear_all_gather import block_extents, build_fibres, replicated
from distdl.nn.module import CollectStateMixin, StateLayout
from distdl.partition import MPIPartition

__all__ = ["DistributedEmbedding"]


def _normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=generator)


class DistributedEmbedding(SeededInit, CollectStateMixin, torch.nn.Module):
    """Look indices up in an embedding table whose embedding dimension is split over ``P_x``'s last axis.

    Args:
        P_x: the partition of the output (of the indices' dimension plus one).
        num_embeddings, embedding_dim: the GLOBAL table shape; ``padding_idx`` as torch's (its row starts
            at zero and gets no gradient).
        max_norm, scale_grad_by_freq, sparse: not supported (ValueError unless the defaults); ``norm_type``, read
            only with ``max_norm``, is taken and unused.
        collect_state: save and load torch's state dict on rank 0 of the root partition (see
            :mod:`distdl.nn.module`).
    Raises:
        ValueError: an unsupported option, a ``padding_idx`` out of range or negative sizes.
    """

    def __init__(self, P_x: MPIPartition, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, collect_state: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        name = "DistributedEmbedding"
        check_partition(name, "P_x", P_x)
        check_features(name, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        (self.collect_state,) = check_flags(name, collect_state=collect_state)
        # norm_type is read only with max_norm (as torch takes it: code porting an inert one runs)
        unsupported = {"max_norm": (max_norm, None), "scale_grad_by_freq": (scale_grad_by_freq, False),
                       "sparse": (sparse, False)}
        for option, (value, default) in unsupported.items():
            if value != default:
                raise ValueError(f"{name}: expected {option}={default!r} (not supported), got {value!r}")
        if padding_idx is not None:
            if (isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral)
                    or not -num_embeddings <= padding_idx < num_embeddings):
                raise ValueError(f"{name}: expected an integer padding_idx in [{-num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx!r}")
            padding_idx = int(padding_idx) % num_embeddings
        self.P_x, self.padding_idx = P_x, padding_idx
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.axes_replicated = tuple(range(P_x.dim - 1))
        build_fibres(P_x, self.axes_replicated)  # the communicators are built here, once
        fibre(P_x, (P_x.dim - 1,))  # the workers sharing a block of indices (check mode compares them)
        # outside P_x an empty (0, embedding_dim) table: see [1] in distdl/nn/linear.py
        lo, hi = (block_extents(self.embedding_dim, P_x.shape[-1])[P_x.index[-1]] if P_x.active
                  else (0, self.embedding_dim))
        rows = self.num_embeddings if P_x.active else 0
        self._init_partition = P_x
        shape = (self.num_embeddings, self.embedding_dim)
        self._init_blocks = {"weight": (shape, (0, lo), (rows, hi - lo), _normal, 0)}
        self.weight = torch.nn.Parameter(torch.empty(rows, hi - lo, dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the table again, as at construction (collective over ``P_x``); the padding row is zero."""
        super().reset_parameters()
        if self.padding_idx is not None and self.weight.shape[0]:
            self.weight[self.padding_idx] = 0

    def _state_layouts(self) -> dict[str, StateLayout]:
        return {"weight": StateLayout((self.num_embeddings, self.embedding_dim), (None, self.P_x.dim - 1))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return this worker's block of the embeddings of ``x`` (zero-volume outside ``P_x``)."""
        name = "DistributedEmbedding"
        self._verify_replicas(name)
        sharing = lambda: fibre(self.P_x, (self.P_x.dim - 1,))  # noqa: E731  (the workers holding these indices)
        try:
            check_tensor(name, x)
            check_idle_input(name, self.P_x, x)
            if not self.P_x.active:
                return self.weight.flatten().clone()  # zero-volume, attached to the (zero-volume) table
            if x.dim() != self.P_x.dim - 1:
                raise ValueError(f"{name}: expected indices of {self.P_x.dim - 1} dimensions for P_x of shape "
                                 f"{self.P_x.shape}, got shape {tuple(x.shape)} on worker {self.P_x._root.rank}")
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name}: expected indices of dtype torch.int64 or torch.int32, got {x.dtype}")
            if x.numel() and not (0 <= int(x.min()) and int(x.max()) < self.num_embeddings):
                raise ValueError(f"{name}: expected indices in [0, {self.num_embeddings}), got values in "
                                 f"[{int(x.min())}, {int(x.max())}] on worker {self.P_x._root.rank}")
        except (TypeError, ValueError) as error:
            announce(name, sharing, error)  # check mode: the workers sharing these indices raise too
            raise
        if check_mode():  # the copies of the indices along the last axis must be equal (no collective reads them)
            verify(name, sharing(), agree={"the indices' shape": tuple(x.shape),
                                           "the indices (checksum)": checksum([x.long()])})  # int32 or int64
        table = replicated(self.weight, self.P_x, self.axes_replicated)
        return torch.nn.functional.embedding(x, table, self.padding_idx)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"P_x shape={self.P_x.shape}, local table shape={tuple(self.weight.shape)}")
