"""bdnd, the daemon, in folders per concern (docs/DESIGN.md, *Map of the code*): ``main`` (flags),
``config``, ``app`` (composition root) and ``errors`` (domain errors) here; ``process``,
``snapshots``, ``store``, ``apply``, ``fetch``, ``serve``, ``swarm``, ``replica``, ``http``,
``observe`` below."""
