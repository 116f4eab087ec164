"""distdl: distributed deep learning over MPI with exact-adjoint data movement."""

from distdl.partition import MPIPartition

__all__ = ["MPIPartition", "__version__"]

__version__ = "0.1.0"
