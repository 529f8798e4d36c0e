"""Driver-facing record of one request inside the coordinator actor (ring 3): progress, outcome,
landing and hot-buffer statistics, and the summary dict ``Coordinator.wait`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestRecord:
    """Driver-facing progress of one request (times from ``time.monotonic`` in the actor)."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    submitted: float
    landed: float | None = None
    finished: float | None = None
    target: str | None = None
    tokens: tuple[int, ...] = ()  # generated tokens
    finish_reason: str | None = None
    error: BaseException | None = None
    hot_hits: int = 0
    hot_misses: int = 0
    landing_bytes: int = 0
    landing_s: float = 0.0  # after prefill: WRITEs, notifications, staging copies, key install
    landing_data_s: float = 0.0  # data movement only: NIXL WRITEs + staging copies
    landing_path: str = ""
    abort_requested: bool = False
    discard: bool = False  # aborted by a caller that will not collect it: drop when done

    @property
    def done(self) -> bool:
        return self.finished is not None

    def summary(self) -> dict:
        decode_s = (self.finished - self.landed) if self.finished and self.landed else None
        n = len(self.tokens)
        looked = self.hot_hits + self.hot_misses
        return {
            "request_id": self.request_id, "prompt_len": self.prompt_len, "target": self.target,
            "generated": n, "tokens": list(self.tokens), "finish_reason": self.finish_reason,
            "error": repr(self.error) if self.error else None,
            "error_type": type(self.error).__name__ if self.error else None,
            "latency_s": (self.finished - self.submitted) if self.finished else None,
            "decode_tokens_per_s": (n / decode_s) if decode_s else None,
            "hot_hit_rate": (self.hot_hits / looked) if looked else None,
            "landing_bytes": self.landing_bytes, "landing_s": self.landing_s,
            "landing_data_s": self.landing_data_s,
            "landing_path": self.landing_path,
        }
