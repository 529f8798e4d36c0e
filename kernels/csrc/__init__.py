"""CUDA sources of the resolver kernels, shipped as package data and compiled at run time."""
