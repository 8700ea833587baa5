"""Rebuilding snapshots from deltas: folding delta chains, sparse apply of spare buffers brought
forward, populated mappings, the header check before READY, delta options."""
