"""A publisher as a real process for the publish-race tests
(``python tests/support/racer.py SPEC_JSON``): once ready it blocks reading a line from stdin
(the test writes one to every racer, so that they start their publish together), then runs ``spec["op"]``
(``full``: :func:`bdn.publish.publish_full` of ``spec["dir"]``; ``commit``:
:func:`bdn.publish.commit_step` with ``spec["config"]`` as ``config.json``) and prints one JSON
line ``{"ok": true}`` or ``{"ok": false, "error": "<type>: <message>"}``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def main() -> None:
    spec = json.loads(sys.argv[1])
    from bdn.bucket import open_bucket
    from bdn.publish import commit_step, publish_full

    b = open_bucket(spec["url"], endpoint_url=spec.get("endpoint"))
    print(json.dumps({"pid": os.getpid(), "ready": True}), flush=True)
    sys.stdin.readline()  # the start line
    try:
        if spec["op"] == "full":
            publish_full(b, spec["identity"], 1, dir=spec["dir"], workers=1, chunk_size=1 << 20, check_headers=False)
        else:
            commit_step(b, spec["identity"], 1, world_size=1, extra_files={"config.json": spec["config"].encode()})
        out = {"ok": True}
    except Exception as e:  # the test reads the error's type and message
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
