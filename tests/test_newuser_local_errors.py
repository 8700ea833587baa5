"""What a new user gets from the local API for a path or a method it does not have.

README.md ("Local API") promises every error as a status code with ``{"error": "<one line>"}``.
aiohttp's router answered an unknown path or a wrong method with its own plain-text body
(``404: Not Found``, ``405: Method Not Allowed``), which ``bdnctl``-style clients and
``curl | python3 -m json.tool`` cannot read. One real daemon, real sockets.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.swarm import Daemon, running

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("newuser-local")
    bucket = work / "bucket"
    bucket.mkdir()
    d = Daemon(work, "node0", f"file://{bucket}", extra_env={"BDN_LOAD_STARTUP": "false"})
    with running(d):
        yield d


def test_an_unknown_path_is_404_with_a_json_error_naming_it(daemon: Daemon) -> None:
    status, body = daemon.request("GET", "/v1/snapshot")
    assert status == 404, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert "/v1/snapshot" in body["error"] and "\n" not in body["error"], body


def test_a_wrong_method_is_405_with_a_json_error_naming_the_allowed_ones(daemon: Daemon) -> None:
    status, body = daemon.request("GET", "/v1/gc")
    assert status == 405, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert "POST" in body["error"] and "/v1/gc" in body["error"], body


def test_known_endpoints_answer_as_before(daemon: Daemon) -> None:
    assert daemon.get("/v1/health")["status"] == "ok"
    status, body = daemon.request("GET", "/v1/snapshots/step000001")
    assert status == 404 and "not known to this daemon" in body["error"], (status, body)
    status, body = daemon.request("POST", "/v1/gc")
    assert status == 200 and "removed" in body, (status, body)


def test_not_found_errors_name_what_was_asked_and_how_to_get_it(daemon: Daemon) -> None:
    """newuser3: an unknown snapshot's 404 told a bdnctl user "(POST .../prefetch to load it)", an
    unknown engine's 404 did not name the id."""
    status, body = daemon.request("GET", "/v1/snapshots/step000042")
    assert status == 404 and "bdnctl prefetch step000042" in body["error"], (status, body)
    status, body = daemon.request("DELETE", "/v1/engines/no-such-engine")
    assert status == 404 and "'no-such-engine'" in body["error"] and "bdnctl engines" in body["error"], body
