"""Actor shells (ring 3, installed as ``hisparse_ray.actors``): plain classes made remote in one
launch module."""
