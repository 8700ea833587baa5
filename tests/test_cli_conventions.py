"""CLI conventions (issue 31, class 11), by running the real commands: a usage error exits 2
(argparse's convention) before anything is contacted; every ``--help`` shows the defaults;
``bdnctl status`` shows readiness and its reason; a swap is told in plain words.

Before the fix: ``bdn-publish`` exited 1 for a malformed identity, an unsupported bucket URL or
compression format and a missing ``--dir``; ``bdnctl verify --timeout -1``, ``hot-load
--inflight-policy bogus`` and ``engines --remove ''`` went to the daemon (exit 3 without one);
``--help`` of bdnctl's commands, bdn-publish and ``python -m bdn.engines`` hid most defaults;
``bdnctl status`` said nothing of readiness.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from bdn.cli import bdnctl, publish
from bdn.cli.helpfmt import DefaultsFormatter
from bdn.client.swap_report import describe_swap
from bdn.engines.__main__ import build_parser as engines_parser
from support.swarm import Daemon, free_port, running

pytestmark = pytest.mark.timeout(600)
PY = sys.executable


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", *argv], capture_output=True, text=True, timeout=240, check=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ck")
    (d / "config.json").write_text("{}")
    return d


def test_usage_errors_exit_2_before_anything_is_contacted(ckpt: Path, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: a usage error must not get as far as 3
    bucket = f"file://{tmp_path}/bucket"
    snap = ["--dir", str(ckpt), "--bucket", bucket, "--policy-version", "1"]
    cases = {
        "publish identity": ("bdn.cli.publish", "full", *snap, "--identity", "a/b"),
        "publish bucket url": (
            "bdn.cli.publish",
            "full",
            "--dir",
            str(ckpt),
            "--bucket",
            "foo://x",
            "--identity",
            "a",
            "--policy-version",
            "1",
        ),
        "publish compression": (
            "bdn.cli.publish",
            "delta",
            *snap,
            "--identity",
            "b",
            "--base",
            "a",
            "--compression-format",
            "zz",
        ),
        "publish missing dir": (
            "bdn.cli.publish",
            "full",
            "--dir",
            str(tmp_path / "nope"),
            "--bucket",
            bucket,
            "--identity",
            "a",
            "--policy-version",
            "1",
        ),
        "publish credentials": (
            "bdn.cli.publish",
            "full",
            *snap,
            "--identity",
            "a",
            "--credentials-file",
            str(tmp_path / "nope.json"),
        ),
        "publish startup identity": ("bdn.cli.publish", "startup", "--bucket", bucket, "--identity", ".."),
        "bdnctl verify timeout": ("bdn.cli.bdnctl", "--url", dead, "verify", "step000001", "--timeout", "-1"),
        "bdnctl inflight policy": (
            "bdn.cli.bdnctl",
            "--url",
            dead,
            "hot-load",
            "step000002",
            "--inflight-policy",
            "bogus",
        ),
        "bdnctl previous": ("bdn.cli.bdnctl", "--url", dead, "hot-load", "step000002", "--previous", "../x"),
        "bdnctl engines remove": ("bdn.cli.bdnctl", "--url", dead, "engines", "--remove", ""),
        "bdnctl timeout nan": ("bdn.cli.bdnctl", "--url", dead, "prefetch", "step000001", "--wait", "--timeout", "nan"),
        "bdnctl unknown flag": ("bdn.cli.bdnctl", "--url", dead, "status", "--bogus"),
        "bdnd unknown flag": ("bdn.daemon.main", "--bogus"),
        "engines timeout": ("bdn.engines", "hf", "--connect-timeout", "soon"),
    }
    for name, argv in cases.items():
        out = _run(*argv)
        assert out.returncode == 2, (name, out.returncode, out.stderr)
        assert out.stderr.strip(), name
    assert not (tmp_path / "bucket").exists()  # nothing was published


def _options(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.Action]]:
    """Every (subcommand path, option) of ``parser`` and its subparsers."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                out += _options(sp, (*path, name))
        elif a.option_strings and a.help is not argparse.SUPPRESS:
            out.append((path, a))
    return out


def _tells_default(a: argparse.Action) -> bool:
    return a.default in (None, False, "", [], argparse.SUPPRESS) or isinstance(a, argparse._VersionAction)


@pytest.mark.parametrize(
    "module,parser",
    [
        ("bdn.cli.bdnctl", bdnctl._parser),
        ("bdn.cli.publish", publish.build_parser),
        ("bdn.engines", engines_parser),
        ("bdn.daemon.main", None),
    ],
)
def test_every_help_shows_the_defaults(module: str, parser) -> None:  # type: ignore[no-untyped-def]
    every = parser is None  # bdnd: its flags default to None (the config's defaults apply), all told
    if parser is None:
        from bdn.daemon.main import build_parser

        parser = build_parser
    checked = 0
    helps: dict[tuple[str, ...], str] = {}
    for path, a in _options(parser()):
        if (_tells_default(a) and not every) or a.dest in ("help", "version", "config"):
            continue
        if path not in helps:
            out = _run(module, *path, "--help")
            assert out.returncode == 0, out.stderr
            helps[path] = " ".join(out.stdout.split())
        flat = helps[path]
        flag = a.option_strings[-1]
        block = flat.split(f" {flag} ", 1)[-1][:400]
        assert "default" in block, (module, path, flag, a.default, block)
        checked += 1
    assert checked >= 2, module


def test_the_formatter_leaves_options_without_a_default_alone() -> None:
    p = argparse.ArgumentParser(formatter_class=DefaultsFormatter)
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--n", type=int, default=3, help="a count")
    p.add_argument("--name", default=None, help="a name")
    text = " ".join(p.format_help().split())
    assert "a count (default: 3)" in text and "a flag (default" not in text and "a name (default" not in text


def test_bdnctl_status_shows_readiness_and_why(tmp_path: Path) -> None:
    empty = tmp_path / "bucket"
    empty.mkdir()
    d = Daemon(tmp_path / "w", "node0", f"file://{empty}", extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    with running(d):
        deadline_out = None
        for _ in range(600):
            out = _run("bdn.cli.bdnctl", "--url", d.url, "status")
            assert out.returncode == 0, out.stderr
            if "holds no object" in out.stdout:
                deadline_out = out.stdout
                break
        assert deadline_out is not None, out.stdout
        lines = deadline_out.splitlines()
        assert "ready     no" in lines, deadline_out
        assert any(line.startswith("because   misconfigured: the bucket") for line in lines), deadline_out
        assert any(line.startswith("waiting   for ") for line in lines), deadline_out


def test_a_swap_is_told_in_plain_words() -> None:
    assert (
        describe_swap({"mode": "partial", "tensors_copied": 75, "tensors_total": 75, "pause_ms": 0.4})
        == "swapped all 75 tensors in place (every one changed), paused 0.40 ms"
    )
    assert (
        describe_swap({"mode": "partial", "tensors_copied": 13, "tensors_total": 51})
        == "swapped the 13 changed tensors of 51 in place (38 unchanged)"
    )
    assert (
        describe_swap({"mode": "load", "full_reload_reason": "config.json changed"})
        == "loaded a new model object (config.json changed)"
    )
    assert describe_swap({"mode": "full", "engine": "vllm"}) == "reloaded every weight from the snapshot"
    assert describe_swap("garbage") == "no swap report"
