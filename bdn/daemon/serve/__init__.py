"""Answering peers: a chunk request minus the wire, upload admission (pure), the transfer server and
client, members' transfer addresses, bad-chunk reports and scrub."""
