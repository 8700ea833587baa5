"""bench/fleetsim: a discrete-event fleet simulator running bdn's own control policies (simpy)."""
