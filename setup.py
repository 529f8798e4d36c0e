"""Builds the optional C ring hot path of the step channel (``hisparse_ray.channel._ring``);
everything else is configured in pyproject.toml. Without a C compiler the install still succeeds
(``optional``) and the rings run the same protocol in Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("hisparse_ray.channel._ring", ["hisparse_ray/channel/_ring.c"],
                             optional=True, extra_compile_args=["-O2", "-Wall"])])
