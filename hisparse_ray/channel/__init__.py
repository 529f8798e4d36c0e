"""The per-step channel between a coordinator and its co-located TP ranks (adapter ring, standard
library): a shared-memory ring per direction, its futex waits, and the step codec."""
