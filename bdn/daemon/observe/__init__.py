"""What the daemon tells about itself and the helpers of its messages: stats, status, metrics,
readiness, problems, loop lag, rate-limited and contextual logging, the chunk log, the opt-in
memory probe, heap trimming, msgpack packing, long-poll versions and bounded bodies."""
