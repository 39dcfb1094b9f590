"""The node cache's metrics, on the dashboard's model cache panels."""

from prometheus_client import Counter, Gauge

REQUESTS = Counter(
    "ebb_model_cache_requests_total",
    "Model requests to the node cache by outcome: hit, miss (fetched from the store), "
    "too_large (over the cache's bound), no_room (the cache full of models being sent), "
    "refused (other 4xx), failed (other 5xx)",
    ["outcome"],
)
SERVED_BYTES = Counter("ebb_model_cache_served_bytes_total", "Model bytes sent to workers")
STORED_BYTES = Gauge("ebb_model_cache_stored_bytes", "Bytes of the models the node cache holds")
EVICTIONS = Counter("ebb_model_cache_evictions_total", "Models removed to keep within the bound")
