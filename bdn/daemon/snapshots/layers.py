"""The two chunk layers of a snapshot (DESIGN.md, "On the node"): ``stored`` (the objects as in
the bucket: a delta's diff files) and ``result`` (the rebuilt files). For a full snapshot, and
for every file of a delta that is not a diff, the two are the same bytes."""

STORED, RESULT = "stored", "result"
