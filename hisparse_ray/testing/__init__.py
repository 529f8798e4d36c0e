"""Helpers shared by the tests, the soak run and the demo's self-check: a pure reference worker and
random protocol driver for the coordinator core, and full-resident reference decode."""
