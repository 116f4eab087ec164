"""Helpers shared by the primitives and layers."""
