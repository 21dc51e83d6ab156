"""A relay's metrics in Prometheus' exposition format, made from its status document.

The relay's loop owns every counter; nothing here runs per transaction (what does, the
produce-latency buckets and refusal counts, is relay/produce_metrics.py, which does not
load prometheus_client). A scrape asks the loop for its status document (relay/node.py
`RelayNode.status`, built between two turns) and `exposition(status)` turns that document
into metric families, so a scrape sees one consistent moment and costs nothing while
nobody scrapes. docs/operations.md lists every
metric with what it means and what to do about it.

Seqs are not metric values: a float64 keeps 53 bits and a seq has 63 (a committed seq
would come out rounded). A stream's committed point is exported as the time in its seq
(`relay_stream_committed_timestamp_seconds`); its exact value is in `/status`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from relay.core.seq import EPOCH_MS, ms_of

__all__ = ["exposition", "families"]


def exposition(status: Mapping[str, Any]) -> bytes:
    """The status document in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(status))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, status: Mapping[str, Any]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        return families(self.status)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def families(status: Mapping[str, Any]) -> Iterator[Metric]:
    """Every metric family of a relay's status document (relay/node.py `status`)."""
    node = status["node"]
    info = _gauge(
        "relay_info",
        "This relay: its id, incarnation and version.",
        ("relay", "incarnation", "version"),
    )
    info.add_metric([str(status["relay"]), str(status["incarnation"]), str(node["version"])], 1)
    yield info
    yield from _stream_families(status["streams"], int(node["wall_ms"]))
    yield from _configuration_families(status["streams"], status["not_member"])
    yield from _relay_families(status, node)
    yield from _metadata_families(status["metadata"])
    yield from _spool_families(status.get("spool"), bool(status["spool_full"]))


def _metadata_families(metadata: Mapping[str, Any]) -> Iterator[Metric]:
    complete = _gauge(
        "relay_metadata_complete",
        "1 while this relay's fold of the metadata stream is complete (durable consumers' "
        "marks and other metadata are readable here).",
    )
    complete.add_metric([], 1 if metadata["complete"] else 0)
    yield complete
    keys = _gauge("relay_metadata_keys", "Keys in this relay's fold of the metadata stream.")
    keys.add_metric([], int(metadata["keys"]))
    yield keys


def _stream_families(streams: Mapping[str, Any], wall_ms: int) -> Iterator[Metric]:
    committed = _counter(
        "relay_stream_committed_records",
        "Records this relay committed (delivered to its readers and spool).",
        ("stream",),
    )
    served = _counter(
        "relay_stream_served_records", "Records this relay sent to consumers.", ("stream",)
    )
    committed_ts = _gauge(
        "relay_stream_committed_timestamp_seconds",
        "The time in the stream's committed seq (a seq's high bits are its coordinator's ms).",
        ("stream",),
    )
    age = _gauge(
        "relay_stream_committed_age_seconds",
        "How old the committed seq is by this relay's clock: grows while nothing commits.",
        ("stream",),
    )
    lag_s = _gauge(
        "relay_stream_commit_lag_seconds",
        "Time between the newest seq this relay holds and its committed seq (0: all committed).",
        ("stream",),
    )
    lag_entries = _gauge(
        "relay_stream_uncommitted_entries",
        "Entries this relay holds above its committed seq (assigned, not yet committed).",
        ("stream",),
    )
    held = _gauge("relay_stream_held_entries", "Entries held in memory.", ("stream",))
    held_bytes = _gauge(
        "relay_stream_held_bytes",
        "Memory of the held entries, their dedupe keys and report log.",
        ("stream",),
    )
    joined = _gauge("relay_stream_joined", "1 once the relay joined the stream.", ("stream",))
    fenced = _gauge(
        "relay_stream_fenced",
        "1 while produces through this relay are answered `fenced`; `reason` says why.",
        ("stream", "reason"),
    )
    repairing = _gauge("relay_stream_repairing", "1 while a repair is under way.", ("stream",))
    stalled = _gauge(
        "relay_stream_stalled_seconds",
        "How long nothing could commit through this relay, and why (0 and '': it can).",
        ("stream", "reason"),
    )
    for name, st in streams.items():
        labels = [name]
        committed.add_metric(labels, int(st["committed_records"]))
        served.add_metric(labels, int(st["served_records"]))
        point, newest = int(st["committed"]), int(st["newest"])
        # A stream with nothing committed yet (its point -1 or 0) has no time: 0 and 0.
        unix_ms = EPOCH_MS + ms_of(point) if point > 0 else 0
        committed_ts.add_metric(labels, unix_ms / 1000)
        age.add_metric(labels, max(wall_ms - unix_ms, 0) / 1000 if unix_ms else 0.0)
        lag_ms = ms_of(newest) - ms_of(point) if newest > point > 0 else 0
        lag_s.add_metric(labels, max(lag_ms, 0) / 1000)
        lag_entries.add_metric(labels, int(st["uncommitted"]))
        held.add_metric(labels, int(st["held"]))
        held_bytes.add_metric(
            labels, int(st["held_bytes"]) + int(st["dedupe_bytes"]) + int(st["report_log_bytes"])
        )
        joined.add_metric(labels, 1 if st["joined"] else 0)
        fenced.add_metric([name, str(st["fence_reason"])], 1 if st["fenced"] else 0)
        repairing.add_metric(labels, 1 if st["repairing"] else 0)
        stall = st["stall"]
        if stall is None:
            stalled.add_metric([name, ""], 0.0)
        else:
            stalled.add_metric([name, str(stall["reason"])], int(stall["for_ms"]) / 1000)
    yield from (committed, served, committed_ts, age, lag_s, lag_entries, held, held_bytes)
    yield from (joined, fenced, repairing, stalled)


def _configuration_families(
    streams: Mapping[str, Any], not_member: Mapping[str, Any]
) -> Iterator[Metric]:
    """Per stream its configuration (docs/protocol.md 5.15) and what keeps it from being
    healthy beyond a fence or a stall: relay/streamhealth.py says which fail readiness."""
    version = _gauge(
        "relay_stream_config_version",
        "The version of the configuration the stream runs under (0: provisional, not "
        "established yet).",
        ("stream",),
    )
    relays = _gauge(
        "relay_stream_config_relays",
        "How many relays the stream's configuration names (the stream's quorum counts them).",
        ("stream",),
    )
    disagree = _gauge(
        "relay_stream_config_disagree",
        "How many peers last stated another configuration of the stream than this relay's.",
        ("stream",),
    )
    differs = _gauge(
        "relay_stream_topology_differs",
        "1 while the topology file names other relays for the stream than the configuration "
        "it runs under (it keeps the configuration).",
        ("stream",),
    )
    lost = _gauge(
        "relay_stream_history_lost",
        "1 once every relay of the stream came back without its history (no spool or store "
        "held it): it began again at the genesis.",
        ("stream",),
    )
    waiting = _gauge(
        "relay_stream_waiting_seconds",
        "How long something has waited to commit while the committed seq did not move "
        "(0: nothing waits).",
        ("stream",),
    )
    diverged = _gauge(
        "relay_stream_diverged_seconds",
        "How long this relay's digest has disagreed with a commit the stream's relays "
        "announced (0: it agrees).",
        ("stream",),
    )
    for name, st in streams.items():
        labels = [name]
        config = st["config"]
        version.add_metric(labels, int(config["version"]))
        relays.add_metric(labels, len(config["relays"]))
        disagree.add_metric(labels, len(config["disagree"]))
        differs.add_metric(labels, 1 if config["relays"] != config["topology"] else 0)
        lost.add_metric(labels, 1 if st["history_lost"] else 0)
        waiting.add_metric(labels, int(st["waiting_ms"]) / 1000)
        diverged.add_metric(labels, int(st["diverged_ms"]) / 1000)
    outside = _gauge(
        "relay_stream_not_member",
        "1 for a stream the topology file names this relay for whose configuration leaves "
        "it out: it does not serve it (reads are redirected, produces forwarded).",
        ("stream",),
    )
    for name in sorted(not_member):
        outside.add_metric([name], 1)
    yield from (version, relays, disagree, differs, lost, waiting, diverged, outside)


def _relay_families(status: Mapping[str, Any], node: Mapping[str, Any]) -> Iterator[Metric]:
    refusals = _counter(
        "relay_produce_refusals",
        "Produces answered other than `committed`, by stream, outcome and reason.",
        ("stream", "outcome", "reason"),
    )
    for item in node["refusals"]:
        refusals.add_metric([item["stream"], item["outcome"], item["reason"]], item["count"])
    yield refusals
    latency = node["produce_latency"]
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip([*latency["bounds_s"], float("inf")], latency["counts"], strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
    histogram = HistogramMetricFamily(
        "relay_produce_latency_seconds",
        "From a produce frame's arrival at this relay to its answer.",
    )
    histogram.add_metric([], buckets, latency["sum_s"])
    yield histogram
    simple = (
        (
            "relay_client_connections",
            "Client connections open to this relay.",
            node["client_connections"],
        ),
        ("relay_pending_produces", "Produces waiting for their outcome.", node["pending_produces"]),
        ("relay_parked_reads", "Consumer reads waiting for records.", node["parked_reads"]),
        ("relay_memory_bytes", "Memory held by every stream's buffers.", status["memory_bytes"]),
        ("relay_memory_max_bytes", "The relay-wide buffer bound.", status["memory_max_bytes"]),
    )
    for name, doc, value in simple:
        gauge = _gauge(name, doc)
        gauge.add_metric([], value)
        yield gauge
    handshakes = _counter(
        "relay_handshakes_refused",
        "Handshakes the client and mesh sockets refused (unknown keys, wrong server keys, ...).",
    )
    handshakes.add_metric([], node["handshakes_refused"])
    yield handshakes
    heard = _gauge("relay_peer_heard", "1 while this relay hears the peer.", ("peer",))
    live = set(status["peers_heard"])
    for peer in node["peers"]:
        heard.add_metric([str(peer)], 1 if peer in live else 0)
    yield heard
    routed = _gauge(
        "relay_peer_routed_via",
        "1 for a peer this relay reaches only through another relay (`via`), protocol 5.13.",
        ("peer", "via"),
    )
    for peer, via in status["route_via"].items():
        routed.add_metric([str(peer), str(via)], 1)
    yield routed
    events = _counter(
        "relay_events",
        "Everything the relay counts (repairs, link gaps, views, refused frames, ...), by name.",
        ("event",),
    )
    merged: dict[str, int] = {}
    for counters in (status["counters"], node["counters"]):
        for event, count in counters.items():
            merged[event] = merged.get(event, 0) + int(count)
    for event, count in sorted(merged.items()):
        events.add_metric([event], count)
    yield events
    repairs = _counter("relay_repairs", "Repairs this relay started (anti-entropy, 5.5).")
    repairs.add_metric([], merged.get("repair_started", 0))
    yield repairs


# What each figure of the spool's status means, as the metrics' help says it.
_SPOOL_HELP = {
    "disk_used_bytes": "Spooled segments on disk the store has not ingested (the store backlog).",
    "pending_bytes": "Committed records not yet written to a segment.",
    "room_bytes": "What the spool can still take within its disk budget.",
    "queue_depth": "Batches queued for the spool's writer thread.",
    "segments_written": "Segments written.",
    "segments_reclaimed": "Segments removed once the store held them.",
    "records_written": "Records written to segments.",
    "bytes_written": "Bytes of segments written.",
    "records_dropped": "Committed records the spool could not take (a bug: report it).",
    "errors": "Spool write errors.",
}


def _spool_families(spool: Mapping[str, Any] | None, full: bool) -> Iterator[Metric]:
    if spool is None:
        return
    figures = (
        (_gauge, "relay_spool_backlog_bytes", "disk_used_bytes"),
        (_gauge, "relay_spool_pending_bytes", "pending_bytes"),
        (_gauge, "relay_spool_room_bytes", "room_bytes"),
        (_gauge, "relay_spool_queue_depth", "queue_depth"),
        (_counter, "relay_spool_segments_written", "segments_written"),
        (_counter, "relay_spool_segments_reclaimed", "segments_reclaimed"),
        (_counter, "relay_spool_records_written", "records_written"),
        (_counter, "relay_spool_bytes_written", "bytes_written"),
        (_counter, "relay_spool_records_dropped", "records_dropped"),
        (_counter, "relay_spool_errors", "errors"),
    )
    for family, name, key in figures:
        metric = family(name, _SPOOL_HELP[key])
        metric.add_metric([], int(spool[key]))
        yield metric
    gauge = _gauge(
        "relay_spool_full", "1 while the spool lacks room: the relay votes nowhere (5.14)."
    )
    gauge.add_metric([], 1 if full else 0)
    yield gauge
    stopped = _gauge(
        "relay_spool_stopped",
        "1 for a stream the spool stopped writing, and why: this relay votes nowhere on it.",
        ("stream", "reason"),
    )
    for stream, why in sorted(spool["stopped_streams"].items()):
        stopped.add_metric([stream, str(why)], 1)
    yield stopped
