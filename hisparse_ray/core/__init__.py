"""Pure core (ring 1): host/device block pools, prefix index, coordinator state machine.

Imports only the standard library; a test enforces it.
"""
