"""Prometheus metrics of one server process (one replica): requests, TTFA, RTF, acceptance,
queue depth, late chunks, codec time, batch occupancy and per-stream lag. Each app gets its own registry,
exposed as text at GET /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFA_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
LAG_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, pool):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pcgtts_requests", "Requests by route and HTTP status", ["route", "status"], registry=r)
        self.ttfa = Histogram("pcgtts_time_to_first_audio_seconds", "Request arrival (queue wait included) "
                              "to first audio chunk", buckets=TTFA_BUCKETS, registry=r)
        self.rtf = Histogram("pcgtts_real_time_factor", "Synthesis time / audio duration per request",
                             buckets=RTF_BUCKETS, registry=r)
        self.audio = Counter("pcgtts_audio_seconds", "Audio generated", registry=r)
        self.codec = Counter("pcgtts_codec_seconds", "Time the codec spent decoding the streams' windows (a "
                             "batched decode's time shared among its windows)", registry=r)
        self.drafted = Counter("pcgtts_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("pcgtts_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Gauge("pcgtts_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self._totals = [0, 0]  # drafted, accepted (for the ratio)
        self.acceptance.set_function(lambda: self._totals[1] / max(self._totals[0], 1))
        self.late = Counter("pcgtts_late_chunks", "Chunks ready after a real-time player ran dry (underruns)",
                            registry=r)
        self.cancelled = Counter("pcgtts_cancelled_streams", "Streams stopped early (disconnect or time limit)",
                                 ["reason"], registry=r)
        Gauge("pcgtts_queue_depth", "Requests waiting for a worker", registry=r).set_function(lambda: pool.waiting)
        Gauge("pcgtts_workers_busy", "Streams being served now (seats of the workers taken)",
              registry=r).set_function(lambda: pool.busy)
        Gauge("pcgtts_workers", "Workers in this replica", registry=r).set_function(lambda: pool.size)
        Gauge("pcgtts_stream_slots", "Streams this replica serves at once (workers x max_batch)",
              registry=r).set_function(lambda: pool.seats)
        Gauge("pcgtts_batch_occupancy", "Share of the batch slots a batched decode step carried, over each "
              "worker's last 100 steps", registry=r).set_function(pool.batch_occupancy)
        self.lag = Histogram("pcgtts_stream_lag_seconds", "Per stream: how long a real-time player started at its "
                             "first chunk waited for audio in all", buckets=LAG_BUCKETS, registry=r)
        Gauge("pcgtts_stream_lag_max_seconds", "The longest such wait among the streams streaming now",
              registry=r).set_function(pool.max_lag)

    def job_done(self, job) -> None:
        """Record a finished (or stopped) job's figures."""
        if job.time_to_first_audio is not None:
            self.ttfa.observe(job.time_to_first_audio)
        stats = job.stats
        if stats is None:
            return
        if stats.real_time_factor is not None and not stats.cancelled:
            self.rtf.observe(stats.real_time_factor)
        self.audio.inc(stats.audio_seconds)
        self.codec.inc(stats.codec_seconds)
        totals = stats.totals()
        self.drafted.inc(totals.drafted)
        self.accepted.inc(totals.accepted)
        self._totals[0] += totals.drafted
        self._totals[1] += totals.accepted
        self.late.inc(job.late_chunks)
        if job.first_chunk_at is not None:
            self.lag.observe(job.stalled)

    def text(self) -> bytes:
        return generate_latest(self.registry)
