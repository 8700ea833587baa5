"""The process around bdnd's services: bounded shutdown, listening sockets, the store's single-daemon
lock, the worker thread pools per kind of blocking work, the injected clock every policy takes,
and the crash tests' pause points (off unless set)."""
