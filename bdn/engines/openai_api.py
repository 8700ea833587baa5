"""An OpenAI-compatible chat server over ``HFEngine`` (aiohttp), with the fields RL trainers collect.

``POST /v1/chat/completions``
    Request (OpenAI's shape): ``model`` (optional: the served name or the snapshot identity),
    ``messages`` (``[{"role": system|user|assistant|tool, "content": str | [{"type": "text",
    "text": str}]}]``), ``max_tokens`` / ``max_completion_tokens`` (default min(64, room)),
    ``temperature`` (0..2, default 1; 0 greedy), ``top_p`` (default 1), ``seed``, ``logprobs``
    (default true), ``top_logprobs`` (0..20), ``n`` (1 only), ``stream`` (false only).
    Response: ``{"id", "object": "chat.completion", "created", "model", "choices": [{"index": 0,
    "message": {"role": "assistant", "content"}, "finish_reason": "stop"|"length"|"abort",
    "token_ids": [...], "logprobs": {"content": [{"token", "logprob", "top_logprobs": [{"token",
    "logprob", "token_id"}]}]}}], "prompt_token_ids", "usage": {"prompt_tokens",
    "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}},
    "nvext": {"engine_data": {"policy_version", "policy_versions", "replica_id",
    "snapshot_identity", "prompt_cache": {"cached_tokens", "policy_version"}}}}``.
    ``policy_versions`` lists every policy the answer's tokens came from (more than one only when
    a hot-load with ``inflight_policy: keep`` happened during it).
    Errors: ``{"error": {"message", "type", "param", "code"}}`` with 400, 404, 503 (nothing loaded).
``GET /v1/models``, ``GET /health`` (503 until a model is loaded),
``GET /debug/weights`` (``{"identity", "policy_version", "tensors": {name: xxh3-128 hex}}``),
``GET /debug/state`` (``{"identity", "policy_version", "in_flight", "swaps", "last_swap",
"prompt_cache_entries"}``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from bdn.engines.chat_params import ChatError, int_param, number_param
from bdn.engines.hf import EngineError, HFEngine

__all__ = ["ChatError", "make_app", "parse_chat"]

MAX_BODY = 1 << 20
MAX_MESSAGES = 1000
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 64
ROLES = ("system", "user", "assistant", "tool")


def parse_chat(body: Any) -> dict[str, Any]:
    """Validate a chat body; the normalised fields. ChatError 400 naming the bad parameter."""
    if not isinstance(body, dict):
        raise ChatError(400, "the body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MESSAGES:
        raise ChatError(400, f"messages must be a list of 1 to {MAX_MESSAGES} entries", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatError(400, f"messages[{i}] must be an object with role one of {', '.join(ROLES)}", "messages")
        c = m.get("content")
        if isinstance(c, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise ChatError(400, f"messages[{i}].content parts must be text parts", "messages")
            c = "".join(p["text"] for p in c)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise ChatError(400, f"messages[{i}].content must be a string or text parts", "messages")
        messages.append({"role": m["role"], "content": c})
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ChatError(400, "model must be a string", "model")
    if int_param(body, "n", 1, 1) not in (None, 1):
        raise ChatError(400, "n must be 1", "n")
    if body.get("stream"):
        raise ChatError(400, "stream is not supported; send stream: false", "stream")
    mt = int_param(body, "max_completion_tokens", 0, 1 << 20)
    if mt is None:
        mt = int_param(body, "max_tokens", 0, 1 << 20)
    lp = body.get("logprobs", True)
    if not isinstance(lp, bool):
        raise ChatError(400, "logprobs must be true or false", "logprobs")
    seed = int_param(body, "seed", -(1 << 63), (1 << 63) - 1)
    return {
        "model": model,
        "messages": messages,
        "max_tokens": mt,
        "temperature": number_param(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": number_param(body, "top_p", 1.0, 1e-9, 1.0),
        "seed": None if seed is None else seed % (1 << 63),
        "logprobs": lp,
        "top_logprobs": int_param(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0,
    }


def _complete(engine: HFEngine, req: dict[str, Any], served_name: str, replica_id: str) -> dict[str, Any]:
    with engine.gate.admit() as ticket:
        if engine.model is None:
            raise ChatError(
                503, "no model is loaded yet: waiting for the first snapshot from bdnd", kind="service_unavailable"
            )
        if req["model"] is not None and req["model"] not in (served_name, engine.identity):
            raise ChatError(404, f"The model `{req['model'][:100]}` does not exist.", "model", "NotFoundError")
        prompt = engine.encode_chat(req["messages"])
        room = engine.max_model_len - len(prompt)
        mt = min(DEFAULT_MAX_TOKENS, room) if req["max_tokens"] is None else req["max_tokens"]
        if room < 1 or mt > room:
            raise ChatError(
                400,
                f"This model's maximum context length is {engine.max_model_len} tokens; the request "
                f"needs {len(prompt) + mt} ({len(prompt)} in the messages).",
                "max_tokens",
            )
        g = engine.generate(
            ticket,
            prompt,
            mt,
            req["temperature"],
            req["top_p"],
            req["seed"],
            req["top_logprobs"] if req["logprobs"] else 0,
        )
    content = None
    if req["logprobs"]:
        content = [
            {
                "token": engine.token_text(t),
                "token_id": t,
                "logprob": lp,
                "top_logprobs": [
                    {"token": engine.token_text(a), "token_id": a, "logprob": b}
                    for a, b in (g.top_logprobs[i] if g.top_logprobs else [])
                ],
            }
            for i, (t, lp) in enumerate(zip(g.token_ids, g.logprobs))
        ]
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": engine.decode(g.token_ids)},
                "finish_reason": g.finish_reason,
                "token_ids": g.token_ids,
                "logprobs": {"content": content} if content is not None else None,
            }
        ],
        "prompt_token_ids": g.prompt_ids,
        "usage": {
            "prompt_tokens": len(g.prompt_ids),
            "completion_tokens": len(g.token_ids),
            "total_tokens": len(g.prompt_ids) + len(g.token_ids),
            "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
        },
        "nvext": {
            "engine_data": {
                "policy_version": g.policy_versions[-1] if g.policy_versions else None,
                "policy_versions": g.policy_versions,
                "replica_id": replica_id,
                "snapshot_identity": g.identity,
                "prompt_cache": {"cached_tokens": g.cached_tokens, "policy_version": g.cache_policy_version},
            }
        },
    }


def make_app(
    engine: HFEngine, served_name: str = "model", replica_id: str = "replica", workers: int = 4
) -> web.Application:
    """The aiohttp application (routes in the module doc); generation runs on ``workers`` threads."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate")

    def err(e: ChatError) -> web.Response:
        return web.json_response(
            {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}, status=e.status
        )

    async def chat(request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                raise ChatError(400, "the body is not JSON") from None
            req = parse_chat(body)
            ans = await asyncio.get_running_loop().run_in_executor(
                pool, _complete, engine, req, served_name, replica_id
            )
        except ChatError as e:
            return err(e)
        except EngineError as e:
            return err(ChatError(503, str(e), kind="service_unavailable"))
        return web.json_response(ans)

    async def models(_r: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": served_name, "object": "model", "owned_by": "bdn", "root": engine.identity}],
            }
        )

    async def health(_r: web.Request) -> web.Response:
        if engine.model is None:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok", "identity": engine.identity, "policy_version": engine.policy_version})

    async def weights(_r: web.Request) -> web.Response:
        d = await asyncio.get_running_loop().run_in_executor(pool, engine.weights_digest)
        return web.json_response({"identity": engine.identity, "policy_version": engine.policy_version, "tensors": d})

    async def state(_r: web.Request) -> web.Response:
        return web.json_response(
            {
                "identity": engine.identity,
                "policy_version": engine.policy_version,
                "in_flight": engine.gate.in_flight,
                "swaps": engine.swaps,
                "last_swap": engine.last_swap,
                "prompt_cache_entries": len(engine.prompt_cache),
            }
        )

    async def close_pool(_app: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/debug/weights", weights)
    app.router.add_get("/debug/state", state)
    app.on_cleanup.append(close_pool)
    return app
