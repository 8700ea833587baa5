"""bench/soak: eight real bdnd daemons for half an hour under faults (issue 12, "Soak").

``python -m bench.soak --nodes 8 --minutes 30 --seed 1 --out bench/results/soak.json`` starts, on
127.0.0.1 only:

- a moto S3 server (the bucket) behind tests/support's ``ChunkFaultProxy`` (the daemons read
  through the proxy, the trainer writes to moto directly);
- ``--nodes`` bdnd processes with one partition secret and an API token (:mod:`.fleet`);
- one reference engine (examples/engine/server.py, a real ``bdn.client.engine`` process) on
  ``node1``;
- a trainer (:mod:`.trainer`) that publishes a tinygpt anchor with ``bdn.publish`` and then a
  delta every 20-30 s (a new anchor every ``--anchor-every`` steps), and POSTs one fleet hot-load
  for each to a random live daemon's peer port with the bearer token;
- a chaos loop (:mod:`.chaos`): kill -9 and restart of daemons (never more than ``--max-down``
  at once; ``node0`` is spared so one daemon lives the whole run), a lying peer
  (tests/support/liar.py) that joins for a while, bursts of bucket 503s at the proxy, and an
  engine crash (kill -9, no unregister) followed by a supervisor-style restart;
- a verifier (:mod:`.verify`) that re-hashes, file by file, every snapshot any daemon reports
  ``ready`` against the trainer's sha256 while it is served, reads a range of it over the local
  API, and checks the engine's weights digest against the trainer's;
- a sampler (:mod:`.sampler`): RSS, open fds, CPU and log lines of every daemon every few seconds.

Every loop stops by itself at the end; every process is killed on exit, also on Ctrl-C or
SIGTERM. The result is one JSON document (:mod:`.report`) plus a short text summary on stdout.
"""
