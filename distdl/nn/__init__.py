"""Distributed modules: the data-movement primitives and the layers built from them."""

from distdl.nn.all_sum_reduce import AllSumReduce

__all__ = ["AllSumReduce"]
