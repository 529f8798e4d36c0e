"""One TP rank's side of a decode step (adapter ring, torch): the step executor, the per-cache
runtime the resolver and attention read, and top-k trace recording."""
