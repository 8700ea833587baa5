"""bdn: peer-to-peer checkpoint distribution for RL rollout fleets."""

__version__ = "0.1.0"
