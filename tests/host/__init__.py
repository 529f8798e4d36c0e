"""Tests of hisparse_ray.host."""
