"""Builds the optional C hot path of the step channel (``hisparse_ray.channel._wire``); everything
else is configured in pyproject.toml. Without a C compiler the install still succeeds
(``optional``) and the channel runs its pure-Python twin."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("hisparse_ray.channel._wire", ["hisparse_ray/channel/_wire.c"],
                             optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wno-unused-label"])])
