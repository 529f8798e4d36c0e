"""The per-step channel between a coordinator and its co-located TP ranks (adapter ring, standard
library + msgspec): one shared-memory ring broadcasting each step's command to every rank, one
ring per rank for its report, their futex waits, and the one stateless step codec."""
