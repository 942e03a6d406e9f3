"""Compiled kernels, below the models that call them."""
