"""Prefill -> decode KV landing: the lander's plan (chunks, WRITE segments, per-rank steps) and
the bounded decode-side staging pool."""
