"""Getting a snapshot's chunks: the chunk-selection policy (pure), the fetcher, its sources (peers
over the transfer wire, the bucket), targets, peers' haves, held and owned chunks, takeover, the
manifest watch, bucket reads, rate limits and the retry policy."""
