"""The daemon's Prometheus metrics (`--metrics-port`), read from its live state
at scrape time: nothing on the request path but counter increments."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from ggml_ffi import describe


class DaemonCollector:
    def __init__(self, daemon):
        self.daemon = daemon

    def collect(self):
        d, stats = self.daemon, self.daemon.stats
        ggml = describe()
        yield InfoMetricFamily("ggml_rpc_ggml", "The libggml this worker computes with and the CPU variant it chose",
                               value={"version": ggml["ggml_version"], "origin": ggml["origin"],
                                      "cpu_variant": ggml["cpu_variant"], "llamafile": ggml["kernels"]["llamafile"],
                                      "tiled_k_quants": str(ggml["kernels"]["tiled_k_quants"]).lower()})
        yield CounterMetricFamily("ggml_rpc_compute_seconds", "Time spent in graph compute",
                                  value=(stats["compute_us"] + d.compute.channel_counts[1]) / 1e6)
        yield CounterMetricFamily("ggml_rpc_computes", "Graph computes run (over step channels too)",
                                  value=stats["computes"] + d.compute.channel_counts[0])
        yield CounterMetricFamily("ggml_rpc_compute_errors", "Graph computes that returned an error",
                                  value=stats["compute_errors"] + d.compute.channel_counts[2])
        yield CounterMetricFamily("ggml_rpc_compute_restarts", "Compute processes lost (abort, crash, timeout)",
                                  value=stats["compute_restarts"])
        yield CounterMetricFamily("ggml_rpc_bytes_in", "Bytes received from clients", value=stats["bytes_in"] + d.compute.channel_counts[3])
        yield CounterMetricFamily("ggml_rpc_bytes_out", "Bytes sent to clients", value=stats["bytes_out"] + d.compute.channel_counts[4])
        yield CounterMetricFamily("ggml_rpc_step_pushes", "Step outputs pushed to a peer worker (step links)",
                                  value=stats["step_pushes"])
        yield CounterMetricFamily("ggml_rpc_step_push_failures", "Step pushes that failed (the client relayed them)",
                                  value=stats["step_push_failures"])
        yield GaugeMetricFamily("ggml_rpc_clients", "Connected clients", value=len(d.connections))
        yield GaugeMetricFamily("ggml_rpc_buffers", "Client buffers allocated", value=len(d.buffers))
        yield GaugeMetricFamily("ggml_rpc_buffer_bytes", "Bytes allocated to clients", value=d.buffers.allocated)
        yield GaugeMetricFamily("ggml_rpc_buffer_bytes_max", "Cap on bytes allocated to clients (--mem)",
                                value=d.buffers.max_bytes)
        yield GaugeMetricFamily("ggml_rpc_compute_bytes", "Bytes of graph intermediates the compute processes "
                                                          "hold (counted against --mem)",
                                value=d.compute.compute_bytes)
        yield GaugeMetricFamily("ggml_rpc_compute_processes", "Compute processes serving clients (one per client "
                                                              "that computes; the spare not counted)",
                                value=len(d.compute.by_client))
        if d.cache is not None:
            yield GaugeMetricFamily("ggml_rpc_tensor_cache_bytes", "Bytes the tensor cache holds on disk",
                                    value=d.cache.bytes)
            yield GaugeMetricFamily("ggml_rpc_tensor_cache_bytes_max", "Cap on the tensor cache (--cache-max)",
                                    value=d.cache.max_bytes)
            yield GaugeMetricFamily("ggml_rpc_tensor_cache_entries", "Entries in the tensor cache",
                                    value=d.cache.entries)
            yield CounterMetricFamily("ggml_rpc_tensor_cache_evictions", "Entries deleted to make room "
                                      "(least recently used first)", value=d.cache.evictions)


def serve_metrics(daemon, host: str, port: int):
    """Expose the daemon's metrics over HTTP on a background thread."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(daemon))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server
