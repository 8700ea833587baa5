"""HTTP adapters at the edge: the peer and local APIs, hot-load, the mapping of domain errors to
statuses, request guards, sendfile bodies; they parse, call a service and map errors."""
