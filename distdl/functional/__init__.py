"""Functional forms of the data-movement primitives (each differentiable; backward is the adjoint)."""

from distdl.functional.all_sum_reduce import all_sum_reduce

__all__ = ["all_sum_reduce"]
