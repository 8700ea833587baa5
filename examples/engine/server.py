#!/usr/bin/env python3
"""bdn's reference serving process: an OpenAI-compatible chat server that hot-swaps policies.

    python examples/engine/server.py --bdn-url http://127.0.0.1:7081 --listen 127.0.0.1:8000 \\
        [--replica-id node0] [--served-model-name tinygpt]

Life: register with the node's bdnd (``bdn.client.EngineLink``; retried for ``--connect-timeout``
seconds, since bdnd and the engine often start together), start serving at once (``/health``
answers 503 until a model is loaded), and run ``bdn.client.run_hot_swap_loop`` in a background
thread: the first offer (the fleet's hot-load target, or STARTUP_SNAPSHOT) is loaded, and every
later one is prepared while requests keep being answered with the old weights, then swapped in
under a lock, then acknowledged with the measured pause. SIGTERM/SIGINT stop it cleanly (exit 0).

The model comes from the snapshot directory: ``model_type: "tinygpt"`` (examples/engine/tinygpt.py,
numpy) is what the demo's trainer publishes. A directory of another model type is refused with a
one-line error acked to the daemon (the replica shows stage ``error``; the old model keeps serving).

HTTP API (OpenAI's ``/v1/chat/completions`` shape, plus the fields RL trainers collect, named as
vLLM names them):

``POST /v1/chat/completions``
    Request: ``model`` (optional; must be the served name or the loaded identity), ``messages``
    (``[{"role": system|user|assistant|tool, "content": str | [{"type": "text", "text": str}]}]``),
    ``max_tokens`` / ``max_completion_tokens`` (default: min(256, what the context leaves)),
    ``temperature`` (0..2, default 1; 0 = greedy), ``top_p`` (default 1), ``seed``,
    ``logprobs`` (default **true** here), ``top_logprobs`` (0..20), ``return_token_ids`` (default
    **true** here), ``n`` (only 1), ``stream`` (only false), and
    ``"nvext": {"extra_fields": ["engine_data"]}``.
    Response: ``{"id": "chatcmpl-…", "object": "chat.completion", "created", "model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content"}, "finish_reason":
    "stop"|"length", "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}]},
    "token_ids": [...]}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
    "prompt_token_ids": [...]}`` plus, when asked, ``"nvext": {"engine_data": {"policy_version",
    "replica_id", "snapshot_identity"}}``. Log-probabilities are those of the model's distribution
    before temperature and top-p (vLLM's default ``raw_logprobs``). One response is always
    produced by one policy: a request holds the policy lock from prompt to last token.
    Errors: ``{"error": {"message", "type", "param", "code"}}`` with 400, 404 (unknown model),
    413, 503 (no model loaded yet).
``GET /v1/models``, ``GET /health`` (503 until loaded), ``GET /debug/weights_digest``
    (``{"digest", "identity", "policy_version"}``: xxh3-128 over the loaded tensors as stored,
    ``tinygpt.weights_digest``; tests compare it with the trainer's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tinygpt.py sits next to this file

import tinygpt  # noqa: E402

from bdn.client import DaemonClient, EngineLink, Snapshot, run_hot_swap_loop  # noqa: E402
from bdn.client.errors import DaemonError, DaemonUnreachable, one_line  # noqa: E402
from bdn.engines.chat_params import ChatError, bool_param, int_param, number_param  # noqa: E402
from bdn.proto.errors import BdnError  # noqa: E402

log = logging.getLogger("engine")

MAX_BODY = 1 << 20
MAX_MESSAGES = 1000
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 256
EXTRA_ENGINE_DATA = "engine_data"


# -- the policy slot ---------------------------------------------------------------------------


class PolicySlot:
    """The loaded model behind a writer-preferring readers/writer lock.

    Requests read (many at once, each for its whole generation); the hot-swap writes. A pending
    swap stops new requests from starting, waits for the running ones to finish, replaces the
    model, and lets everyone go: so no response mixes two policies, and serving pauses only for
    the drain plus the replacement. The lock is what an engine that updates weights in place
    (GPU memory holds one copy) needs; this engine swaps a reference, so its pause is short.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writers_waiting = 0
        self._writing = False
        self.model: tinygpt.Model | None = None

    @contextlib.contextmanager
    def reading(self) -> Iterator[tinygpt.Model | None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield self.model
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    def swap(self, model: tinygpt.Model) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._readers or self._writing:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            self.model = model
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def peek(self) -> tinygpt.Model | None:
        """The current model without taking the lock (for status answers, not for generation)."""
        return self.model


def load_model(snapshot: Snapshot) -> tinygpt.Model:
    """The model of a snapshot directory, chosen by ``config.json``'s ``model_type``."""
    config = snapshot.path / "config.json"
    try:
        model_type = json.loads(config.read_bytes()[: tinygpt.MAX_CONFIG_BYTES]).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise tinygpt.CheckpointError(f"{config}: cannot read model_type ({exc})") from None
    if model_type != tinygpt.MODEL_TYPE:
        raise tinygpt.CheckpointError(
            f"model_type {str(model_type)[:60]!r} is not served by this reference engine (it serves {tinygpt.MODEL_TYPE!r})"
        )
    return tinygpt.load_from_snapshot(snapshot)


# -- requests ----------------------------------------------------------------------------------

RequestError = ChatError  # the shared rules (bdn/engines/chat_params.py) raise it


def _error_response(err: RequestError) -> web.Response:
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}
    return web.json_response(body, status=err.status)


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    engine_data: bool


def _content(value: Any, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    400, f'messages[{i}].content parts must be {{"type": "text", "text": str}}', "messages"
                )
            parts.append(part["text"])
        return "".join(parts)
    if value is None:
        return ""
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body; RequestError (400) naming the bad parameter."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "model must be a string", "model")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise RequestError(400, f"messages holds more than {MAX_MESSAGES} entries", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in tinygpt.CHAT_ROLES:
            raise RequestError(400, f"messages[{i}].role must be one of {', '.join(tinygpt.CHAT_ROLES)}", "messages")
        messages.append({"role": role, "content": _content(m.get("content"), i)})
    if int_param(body, "n", 1, 1) not in (None, 1):
        raise RequestError(400, "n must be 1", "n")
    if body.get("stream"):
        raise RequestError(400, "stream is not supported by this engine; send stream: false", "stream")
    max_tokens = int_param(body, "max_completion_tokens", 0, 1 << 20)
    if max_tokens is None:
        max_tokens = int_param(body, "max_tokens", 0, 1 << 20)
    seed = int_param(body, "seed", -(1 << 63), (1 << 64) - 1)
    nvext = body.get("nvext")
    engine_data = False
    if nvext is not None:
        extra = nvext.get("extra_fields") if isinstance(nvext, dict) else None
        if not isinstance(nvext, dict) or (
            extra is not None and (not isinstance(extra, list) or not all(isinstance(x, str) for x in extra))
        ):
            raise RequestError(400, "nvext must be an object whose extra_fields is a list of strings", "nvext")
        engine_data = EXTRA_ENGINE_DATA in (extra or [])
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=number_param(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number_param(body, "top_p", 1.0, 1e-9, 1.0),
        seed=None if seed is None else seed % (1 << 64),  # numpy seeds are unsigned
        logprobs=bool_param(body, "logprobs", True),
        top_logprobs=int_param(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0,
        return_token_ids=bool_param(body, "return_token_ids", True),
        engine_data=engine_data,
    )


def _token_entry(tok: tinygpt.ByteTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tok.token_text(token_id), "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}


# -- the server --------------------------------------------------------------------------------


class EngineServer:
    """The HTTP side: routes, request validation, generation on a thread pool."""

    def __init__(self, slot: PolicySlot, served_model_name: str, replica_id: str, workers: int = 4) -> None:
        self.slot = slot
        self.served_model_name = served_model_name
        self.replica_id = replica_id
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate")
        self.started = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/debug/weights_digest", self.weights_digest)
        return app

    def _complete(self, req: ChatRequest) -> dict[str, Any]:
        """Runs on a pool thread, holding the policy lock for the whole generation."""
        with self.slot.reading() as model:
            if model is None:
                raise RequestError(
                    503, "no model is loaded yet: waiting for the first snapshot from bdnd", kind="service_unavailable"
                )
            if req.model is not None and req.model not in (self.served_model_name, model.identity):
                raise RequestError(404, f"The model `{req.model[:100]}` does not exist.", "model", "NotFoundError")
            tok = model.tokenizer
            prompt = tok.encode_chat(req.messages)
            room = model.max_model_len - len(prompt)
            max_tokens = min(DEFAULT_MAX_TOKENS, room) if req.max_tokens is None else req.max_tokens
            if room < 1 or max_tokens > room:
                raise RequestError(
                    400,
                    f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                    f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                    f"{max_tokens} in the completion).",
                    "max_tokens",
                )
            gen = model.generate_detailed(
                prompt,
                max_tokens,
                req.temperature,
                req.seed,
                top_p=req.top_p,
                top_logprobs=req.top_logprobs if req.logprobs else 0,
            )
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": tok.decode(gen.token_ids)},
                "finish_reason": gen.finish_reason,
                "logprobs": None,
            }
            if req.logprobs:
                content = []
                for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.logprobs)):
                    entry = _token_entry(tok, tid, lp)
                    entry["top_logprobs"] = (
                        [_token_entry(tok, t, p) for t, p in gen.top_logprobs[i]] if gen.top_logprobs else []
                    )
                    content.append(entry)
                choice["logprobs"] = {"content": content}
            if req.return_token_ids:
                choice["token_ids"] = gen.token_ids
            out: dict[str, Any] = {
                "id": "chatcmpl-" + secrets.token_hex(12),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.model or self.served_model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(gen.token_ids),
                    "total_tokens": len(prompt) + len(gen.token_ids),
                },
            }
            if req.return_token_ids:
                out["prompt_token_ids"] = prompt
            if req.engine_data:
                out["nvext"] = {
                    "engine_data": {
                        "policy_version": model.policy_version,
                        "replica_id": self.replica_id,
                        "snapshot_identity": model.identity,
                    }
                }
            return out

    async def chat(self, request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as exc:
                raise RequestError(400, f"the body is not valid JSON ({one_line(str(exc), 200)})") from None
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(413, f"the body exceeds {MAX_BODY} bytes") from None
            req = parse_chat_request(body)
            loop = asyncio.get_running_loop()
            return web.json_response(await loop.run_in_executor(self.pool, self._complete, req))
        except RequestError as err:
            return _error_response(err)

    async def models(self, request: web.Request) -> web.Response:
        m = self.slot.peek()
        data = []
        if m is not None:
            data.append(
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "bdn",
                    "root": m.identity,
                    "max_model_len": m.max_model_len,
                    "policy_version": m.policy_version,
                }
            )
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        m = self.slot.peek()
        if m is None:
            return web.json_response({"status": "loading", "replica_id": self.replica_id}, status=503)
        return web.json_response(
            {"status": "ok", "replica_id": self.replica_id, "identity": m.identity, "policy_version": m.policy_version}
        )

    async def weights_digest(self, request: web.Request) -> web.Response:
        m = self.slot.peek()
        if m is None:
            return _error_response(RequestError(503, "no model is loaded yet", kind="service_unavailable"))
        return web.json_response({"digest": m.digest, "identity": m.identity, "policy_version": m.policy_version})


# -- process life ------------------------------------------------------------------------------


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"--listen must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _register(url: str, name: str, timeout: float) -> EngineLink:
    """Register with bdnd, retrying while it is not up yet (it may start with the engine)."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return EngineLink(url, name=name)
        except DaemonUnreachable as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.info("bdnd not reachable yet (%s); retrying", exc.reason)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _serve(args: argparse.Namespace) -> int:
    link = await asyncio.to_thread(_register, args.bdn_url, args.name, args.connect_timeout)
    replica_id = args.replica_id
    if not replica_id:
        with DaemonClient(args.bdn_url) as dc:
            replica_id = str(dc.health().get("node_id") or "replica")
    slot = PolicySlot()
    server = EngineServer(slot, args.served_model_name, replica_id, args.workers)
    stop = threading.Event()
    swapper = threading.Thread(
        target=run_hot_swap_loop,
        args=(link, load_model, lambda model, _snap: slot.swap(model)),
        kwargs={"stop": stop, "poll_timeout": args.poll_timeout},
        name="hot-swap",
        daemon=True,  # a long-poll in flight must not hold the process at exit
    )
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    host, port = args.listen
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        link.close()
        raise SystemExit(f"server.py: error: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    swapper.start()
    print(f"engine {link.engine_id} ({replica_id}) serving on http://{host}:{port}, bdnd {args.bdn_url}", flush=True)

    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    log.info("stopping")
    stop.set()
    await runner.cleanup()
    server.pool.shutdown(wait=False, cancel_futures=True)
    await asyncio.to_thread(link.close)
    swapper.join(timeout=1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="server.py", description="bdn's reference serving process (OpenAI-compatible chat, hot-swapped policies)."
    )
    p.add_argument("--bdn-url", default="http://127.0.0.1:7081", help="the node's bdnd local API (default %(default)s)")
    p.add_argument(
        "--listen", type=_listen, default=("127.0.0.1", 8000), help="HOST:PORT to serve on (default 127.0.0.1:8000)"
    )
    p.add_argument("--replica-id", default="", help="reported in nvext.engine_data (default: bdnd's node id)")
    p.add_argument("--served-model-name", default="tinygpt", help="the model name clients send (default %(default)s)")
    p.add_argument("--name", default="tinygpt-engine", help="this engine's name in bdnd's logs")
    p.add_argument("--workers", type=int, default=4, help="generation threads (default %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to keep trying to reach bdnd at start")
    p.add_argument("--poll-timeout", type=float, default=10.0, help="seconds per long-poll for the next snapshot")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("httpx", "httpcore"):  # httpx logs every request to bdnd (each long-poll) at INFO
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return asyncio.run(_serve(args))
    except (DaemonUnreachable, DaemonError) as exc:
        print(f"server.py: error: {exc}", file=sys.stderr)
        return 1
    except BdnError as exc:
        print(f"server.py: error: {one_line(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
