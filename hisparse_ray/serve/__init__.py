"""Ray Serve front door (ring 3): the OpenAI-compatible app (:func:`build_openai_app`) in front
of the HiSparse deployment (:class:`~hisparse_ray.serve.server.HiSparseServer`). Importing this
package needs no Ray Serve; building the app does (``pip install 'hisparse-ray[serve]'``)."""

from hisparse_ray.serve.builder import build_openai_app, build_engine_app

__all__ = ["build_openai_app", "build_engine_app"]
