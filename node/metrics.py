"""Prometheus metrics of one worker node (own registry: several nodes can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Counter(
            "needle_jobs", "Jobs by outcome (claimed, committed, verified, failed, lost, error)",
            ["outcome"], registry=r,
        )
        self.flops = Counter(
            "needle_flops", "Floating-point operations of verified jobs", registry=r
        )
        self.verifications = Counter(
            "needle_verifications", "Finalisation outcomes of this node's results", ["result"],
            registry=r,
        )
        self.stage_latency = Histogram(
            "needle_stage_seconds", "Seconds spent per job stage (fetch, compute, upload, commit, "
            "finalize, total)", ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "needle_jobs_in_flight", "Jobs claimed and not yet finished", registry=r
        )
        self.earned = Gauge("needle_earned_wei", "Fees earned by verified jobs (wei)", registry=r)
        self.stake = Gauge("needle_stake_wei", "This worker's stake on chain (wei)", registry=r)
        self.chain_errors = Counter(
            "needle_chain_errors", "Transient chain or blob-store errors retried", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
