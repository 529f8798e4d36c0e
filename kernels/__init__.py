"""Resolver kernels (ring 2, installed as ``hisparse_ray.kernels``): CUDA via CuPy plus a
bit-exact pure-torch twin in ``reference``; this module is the one dispatch point."""
