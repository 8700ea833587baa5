"""The swarm's membership: SWIM transport, seeds and DNS, the member table and live set per epoch,
signed peer requests and their replay windows."""
