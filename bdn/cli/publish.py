"""``bdn-publish``: publish snapshots from the trainer side (DESIGN.md, "Surfaces").

::

    bdn-publish full    --dir D --bucket URL --identity ID --policy-version N [--chunk-size BYTES]
    bdn-publish delta   --dir D --bucket URL --identity ID --policy-version N --base ID
                        [--base-dir D] [--compression-format arc_v2]
    bdn-publish startup --bucket URL --identity ID

Common options: ``--credentials-file`` (JSON credentials for the bucket), ``--endpoint-url``
(an S3-compatible endpoint), ``--workers``, ``--overwrite``, ``--json``. The command only maps
flags onto :mod:`bdn.publish`. Exit status: 0 on success, 1 with one line ``bdn-publish: error:
<message>`` on stderr when bdn refuses or fails, 2 for a usage error. ``--version`` prints
``bdn <version>``.

Output: one summary line; sizes in SI units (``MB`` = 10^6 bytes, the upload bar too). With
``--json``, one JSON object on stdout instead, byte counts as integers: for ``full``/``delta``
``{"identity", "kind", "base_identity", "policy_version", "stored_bytes", "result_bytes",
"files", "seconds"}``, for ``startup`` ``{"startup_snapshot"}``, and on failure ``{"error",
"exit_code"}`` (the stderr line stays).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from bdn.cli.helpfmt import DefaultsFormatter
from bdn.cli.output import BYTES_BAR, VERSION, emit_json, human_bytes
from bdn.proto.chunks import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from bdn.proto.errors import BdnError

if TYPE_CHECKING:
    from bdn.proto.manifest import Manifest

PROG = "bdn-publish"


def _chunk_size(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not MIN_CHUNK_SIZE <= v <= MAX_CHUNK_SIZE:
        raise argparse.ArgumentTypeError(f"must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes")
    return v


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _identity(text: str) -> str:
    from bdn.proto.identity import validate_identity

    try:
        return validate_identity(text)
    except BdnError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bucket_url(text: str) -> str:
    from bdn.bucket.urls import check_bucket_url

    try:
        check_bucket_url(text)
    except (BdnError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def _readable_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a readable file")
    return text


def _compression(text: str) -> str:
    from bdn.proto.arc import COMPRESSION_FORMATS

    if text.lower() not in COMPRESSION_FORMATS:
        raise argparse.ArgumentTypeError(f"unsupported {text!r}: bdn supports {', '.join(COMPRESSION_FORMATS)}")
    return text.lower()


def _positive(text: str) -> int:
    v = _non_negative(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # no prefix matching: "--partition-secret X" was taken as --partition-secret-file X
        # (a new user's report; the error then printed the secret as a file name)
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)  # every --help shows the defaults
        super().__init__(*args, **kwargs)

    json_mode = False  # set by main() from its argv: a usage error with --json is JSON too

    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; the rule is one line (as bdnctl), exit 2.
        if _Parser.json_mode:
            emit_json({"error": message, "exit_code": 2})
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bdn-publish`` (subcommands ``full``, ``delta``, ``startup``)."""
    parser = _Parser(
        prog=PROG,
        description="Publish checkpoints to a bucket for bdn daemons to distribute.",
        epilog="exit status: 0 published; 1 bdn refused or failed (one line 'bdn-publish: error: ...'); "
        "2 usage error. Run 'bdn-publish COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=VERSION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{full,delta,startup}", parser_class=_Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        p.add_argument(
            "--bucket", required=True, type=_bucket_url, help="s3://bucket/prefix, gs://bucket/prefix or file:///dir"
        )
        p.add_argument("--identity", required=True, type=_identity, help="snapshot identity, e.g. step000002")
        p.add_argument("--credentials-file", type=_readable_file, help="JSON file with the bucket credentials")
        p.add_argument("--endpoint-url", help="S3-compatible endpoint URL")

    def snapshot(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument("--dir", required=True, type=_directory, help="Hugging Face checkpoint directory to publish")
        p.add_argument("--policy-version", required=True, type=_non_negative, help="integer policy version")
        p.add_argument(
            "--chunk-size",
            type=_chunk_size,
            default=DEFAULT_CHUNK_SIZE,
            help=f"chunk size in bytes (default {DEFAULT_CHUNK_SIZE})",
        )
        p.add_argument("--workers", type=_positive, default=8, help="files uploaded at a time (default 8)")
        p.add_argument("--overwrite", action="store_true", help="replace a snapshot that is already published")

    full = sub.add_parser("full", help="publish a full snapshot (an anchor)")
    snapshot(full)
    delta = sub.add_parser("delta", help="publish a delta against a published base snapshot")
    snapshot(delta)
    delta.add_argument("--base", required=True, type=_identity, help="identity of the published base snapshot")
    delta.add_argument(
        "--base-dir",
        type=_directory,
        help="local copy of the base checkpoint (default: download it from the bucket)",
    )
    delta.add_argument(
        "--compression-format",
        default="arc_v2",
        type=_compression,
        help="arc_v2 (zstd, default), arc_v1 (zlib) or bdn_planes_v1 (bdn's own, smaller; bdnd only)",
    )
    startup = sub.add_parser("startup", help="point STARTUP_SNAPSHOT at a published snapshot")
    common(startup)
    return parser


def _summary(m: Manifest, seconds: float) -> str:
    return (
        f"published {m.identity} ({m.kind}"
        + (f" of {m.base_identity}" if m.base_identity else "")
        + f", policy version {m.policy_version}): {len(m.files)} files, "
        f"{human_bytes(m.stored_bytes)} stored, rebuilds {human_bytes(m.result_bytes)}, {seconds:.2f} s"
    )


def _summary_json(m: Manifest, seconds: float) -> dict[str, object]:
    return {
        "identity": m.identity,
        "kind": m.kind,
        "base_identity": m.base_identity,
        "policy_version": m.policy_version,
        "stored_bytes": m.stored_bytes,
        "result_bytes": m.result_bytes,
        "files": len(m.files),
        "seconds": round(seconds, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bdn-publish``; returns the exit status (argparse exits 2 on a usage error)."""
    _Parser.json_mode = "--json" in (sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # Imported after parsing: boto3 and numpy take most of a second, usage errors need neither.
    from tqdm import tqdm

    from bdn.bucket import open_bucket
    from bdn.publish import publish_delta, publish_full, publish_startup
    from bdn.publish.tree import scan_dir

    try:
        bucket = open_bucket(args.bucket, credentials_file=args.credentials_file, endpoint_url=args.endpoint_url)
        with bucket:
            if args.command == "startup":
                publish_startup(bucket, args.identity)
                if args.json:
                    emit_json({"startup_snapshot": args.identity})
                else:
                    print(f"STARTUP_SNAPSHOT names {args.identity}")
                return 0
            start = time.monotonic()
            # disable=None: a bar on a terminal, silence when stderr is a pipe or a log file.
            total = sum(f.size for f in scan_dir(args.dir)) if args.command == "full" else None
            with tqdm(total=total, desc="uploaded", **BYTES_BAR, disable=True if args.json else None) as bar:
                if args.command == "full":
                    m = publish_full(
                        bucket,
                        args.identity,
                        args.policy_version,
                        dir=args.dir,
                        chunk_size=args.chunk_size,
                        workers=args.workers,
                        overwrite=args.overwrite,
                        progress=bar.update,
                    )
                else:
                    m = publish_delta(
                        bucket,
                        args.identity,
                        args.policy_version,
                        args.base,
                        dir=args.dir,
                        base_dir=args.base_dir,
                        compression_format=args.compression_format,
                        chunk_size=args.chunk_size,
                        workers=args.workers,
                        overwrite=args.overwrite,
                        progress=bar.update,
                    )
            seconds = time.monotonic() - start
            if args.json:
                emit_json(_summary_json(m, seconds))
            else:
                print(_summary(m, seconds))
            return 0
    except BdnError as e:
        return _fail(" ".join(str(e).split()) or type(e).__name__, 1, args.json)
    except KeyboardInterrupt:
        return _fail("interrupted; the snapshot was not published", 130, args.json)


def _fail(message: str, code: int, json_mode: bool) -> int:
    if json_mode:
        emit_json({"error": message, "exit_code": code})
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
