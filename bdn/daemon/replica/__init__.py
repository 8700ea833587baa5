"""The replica: the fleet's target and its order (pure), this node's view (target, current, engines,
leases, offers), hot-load requests and gossip, fleet status, the hosted contract, claims, changed
tensors, engines and the ports the replica reaches the snapshots through."""
