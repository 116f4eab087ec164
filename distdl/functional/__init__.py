"""Functional forms of the data-movement primitives (each differentiable; backward is the adjoint)."""

from distdl.functional.all_gather import all_gather
from distdl.functional.all_sum_reduce import all_sum_reduce
from distdl.functional.broadcast import broadcast
from distdl.functional.halo_exchange import halo_exchange, halo_exchange_adjoint
from distdl.functional.invariant import all_sum_reduce_backward, all_sum_reduce_forward
from distdl.functional.reduce_scatter import reduce_scatter
from distdl.functional.repartition import repartition
from distdl.functional.sum_reduce import sum_reduce
from distdl.functional.window_exchange import window_exchange, window_scatter_add

__all__ = ["all_gather", "all_sum_reduce", "all_sum_reduce_backward", "all_sum_reduce_forward", "broadcast",
           "halo_exchange", "halo_exchange_adjoint", "reduce_scatter", "repartition", "sum_reduce",
           "window_exchange", "window_scatter_add"]
