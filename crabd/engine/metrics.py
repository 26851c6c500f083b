"""The host engine's metrics: counters, histograms, and their Prometheus text form.

Histograms keep cumulative buckets (what Prometheus scrapes) and the last
:data:`WINDOW` samples (what the API reports as p50/p95/max, so an operator
sees the recent behaviour rather than the average since start-up).

Names (all prefixed ``crab_engine_``)::

    jobs_submitted_total{kind}          jobs_finished_total{state}
    bytes_written_total                 promotions_total
    bytes_uploaded_total
    promotions_running_total            job_run_seconds_total{priority}
    backpressure_waits_total            backpressure_seconds_total
    queue_depth{priority}  (gauge)      running (gauge)
    queue_wait_seconds     (histogram)  job_seconds{kind} (histogram)
    exposed_delay_seconds  (histogram)  -- one sample per agent wait on a job
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

#: Samples kept per histogram for the API's quantiles.
WINDOW = 4096
#: Bucket bounds in seconds: fine near zero (exposed delay is mostly 0), coarse up to a minute.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value
        self.n += 1
        self.recent.append(value)

    def summary(self) -> dict[str, float]:
        values = sorted(self.recent)
        return {
            "count": self.n,
            "sum": self.total,
            "p50": quantile(values, 0.5),
            "p95": quantile(values, 0.95),
            "max": values[-1] if values else 0.0,
        }

    def prometheus(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        lines = []
        running = 0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        lines.append(f"{name}_sum{suffix} {self.total:.6f}")
        lines.append(f"{name}_count{suffix} {self.n}")
        return lines


@dataclass
class EngineMetrics:
    submitted: Counter[str] = field(default_factory=Counter)
    finished: Counter[str] = field(default_factory=Counter)
    bytes_written: int = 0
    #: Compressed bytes uploads sent to the remote tier.
    bytes_uploaded: int = 0
    promotions: int = 0
    #: Promotions of jobs already running (their helpers went back to normal priority).
    promotions_running: int = 0
    #: Seconds finished jobs ran with their helpers at background priority, and at normal priority.
    demoted_s: float = 0.0
    promoted_s: float = 0.0
    backpressure_waits: int = 0
    backpressure_s: float = 0.0
    queue_wait: Histogram = field(default_factory=Histogram)
    job_seconds: dict[str, Histogram] = field(default_factory=dict)
    exposed: Histogram = field(default_factory=Histogram)

    def job_histogram(self, kind: str) -> Histogram:
        return self.job_seconds.setdefault(kind, Histogram())

    def snapshot(self) -> dict[str, Any]:
        return {
            "submitted": dict(self.submitted),
            "finished": dict(self.finished),
            "bytes_written": self.bytes_written,
            "bytes_uploaded": self.bytes_uploaded,
            "promotions": self.promotions,
            "promotions_running": self.promotions_running,
            "demoted_s": self.demoted_s,
            "promoted_s": self.promoted_s,
            "backpressure_waits": self.backpressure_waits,
            "backpressure_s": self.backpressure_s,
            "queue_wait_s": self.queue_wait.summary(),
            "job_s": {k: h.summary() for k, h in sorted(self.job_seconds.items())},
            "exposed_delay_s": self.exposed.summary(),
        }

    def prometheus(self, *, pending: dict[str, int], running: int) -> str:
        p = "crab_engine_"
        out = [
            f"# HELP {p}jobs_submitted_total Checkpoint jobs queued, by kind.",
            f"# TYPE {p}jobs_submitted_total counter",
            *(f'{p}jobs_submitted_total{{kind="{k}"}} {v}' for k, v in sorted(self.submitted.items())),
            f"# HELP {p}jobs_finished_total Checkpoint jobs finished, by final state.",
            f"# TYPE {p}jobs_finished_total counter",
            *(f'{p}jobs_finished_total{{state="{k}"}} {v}' for k, v in sorted(self.finished.items())),
            f"# HELP {p}bytes_written_total Bytes newly written to the checkpoint store by jobs.",
            f"# TYPE {p}bytes_written_total counter",
            f"{p}bytes_written_total {self.bytes_written}",
            f"# HELP {p}bytes_uploaded_total Compressed bytes uploads sent to the remote tier.",
            f"# TYPE {p}bytes_uploaded_total counter",
            f"{p}bytes_uploaded_total {self.bytes_uploaded}",
            f"# HELP {p}promotions_total Jobs promoted to urgent because an agent blocked on them.",
            f"# TYPE {p}promotions_total counter",
            f"{p}promotions_total {self.promotions}",
            f"# HELP {p}promotions_running_total Promotions of running jobs: their helpers back to normal priority.",
            f"# TYPE {p}promotions_running_total counter",
            f"{p}promotions_running_total {self.promotions_running}",
            f"# HELP {p}job_run_seconds_total Seconds finished jobs ran, by the priority of their helpers.",
            f"# TYPE {p}job_run_seconds_total counter",
            f'{p}job_run_seconds_total{{priority="background"}} {self.demoted_s:.6f}',
            f'{p}job_run_seconds_total{{priority="normal"}} {self.promoted_s:.6f}',
            f"# HELP {p}backpressure_waits_total Turn ends that waited for room in a full queue.",
            f"# TYPE {p}backpressure_waits_total counter",
            f"{p}backpressure_waits_total {self.backpressure_waits}",
            f"# HELP {p}backpressure_seconds_total Seconds turn ends waited for room in a full queue.",
            f"# TYPE {p}backpressure_seconds_total counter",
            f"{p}backpressure_seconds_total {self.backpressure_s:.6f}",
            f"# HELP {p}queue_depth Jobs waiting to start, by priority.",
            f"# TYPE {p}queue_depth gauge",
            *(f'{p}queue_depth{{priority="{k}"}} {v}' for k, v in sorted(pending.items())),
            f"# HELP {p}running Jobs running now.",
            f"# TYPE {p}running gauge",
            f"{p}running {running}",
            f"# HELP {p}queue_wait_seconds Time from a job's submission to its start.",
            f"# TYPE {p}queue_wait_seconds histogram",
            *self.queue_wait.prometheus(f"{p}queue_wait_seconds"),
            f"# HELP {p}job_seconds Time a job ran (dumping and versioning), by kind.",
            f"# TYPE {p}job_seconds histogram",
        ]
        for kind, hist in sorted(self.job_seconds.items()):
            out.extend(hist.prometheus(f"{p}job_seconds", f'kind="{kind}"'))
        out += [
            f"# HELP {p}exposed_delay_seconds Time an agent waited on a checkpoint (0 when it was hidden).",
            f"# TYPE {p}exposed_delay_seconds histogram",
            *self.exposed.prometheus(f"{p}exposed_delay_seconds"),
        ]
        return "\n".join(out) + "\n"
