"""Transports between torch tensors and MPI."""
