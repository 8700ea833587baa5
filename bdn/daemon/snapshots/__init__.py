"""Snapshots and their lifecycle: the catalog (prefetch, wait, cancel, repair, GC, budget), one
snapshot's runner, its record and the events that alone change it, manifest polling, foreign
snapshots, layers, the retention policy, restart records and the bounded set of collected
identities."""
