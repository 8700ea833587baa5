"""Rollouts from engines that bdn hot-loads: a small client of their OpenAI-compatible chat API.

Each rollout is one ``POST /v1/chat/completions`` (``n = 1``, ``logprobs: true``) to an engine
such as bdn's transformers engine (``python -m bdn.engines hf``, bdn/engines/openai_api.py); the
answer's ``prompt_token_ids``, ``choices[0].token_ids`` and per-token log-probabilities are what
a trainer trains on, and ``nvext.engine_data.policy_versions`` says which policies made the tokens.
``GET /health`` (``{"status": "ok", "policy_version": N}``, 503 while nothing is loaded) says which
policy an engine serves now.

Every answer is untrusted input: a field of the wrong type, token ids that are not integers,
log-probabilities not one per completion token, or no policy version raise
:class:`EngineAnswerError` naming the engine and the field.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self

import httpx

__all__ = ["EngineAnswerError", "EnginePool", "Rollout", "parse_answer"]


class EngineAnswerError(RuntimeError):
    """An engine's answer was an error status or malformed; one line naming the engine and field."""


@dataclass(frozen=True)
class Rollout:
    """One completion: token ids of the prompt (as the engine's chat template rendered it) and of
    the completion, one log-probability per completion token, the policy versions its tokens came
    from (oldest first as the engine lists them), and which engine and snapshot served it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    replica_id: str
    identity: str
    engine_url: str


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise EngineAnswerError(f"{what} is not a list of integers")
    return v


def parse_answer(url: str, ans: Any) -> Rollout:
    """A :class:`Rollout` from one decoded chat answer of the engine at ``url``;
    EngineAnswerError for a malformed one."""
    try:
        if not isinstance(ans, dict):
            raise EngineAnswerError("the answer is not a JSON object")
        choice = ans["choices"][0]
        ids = _ints(choice["token_ids"], "choices[0].token_ids")
        prompt = _ints(ans["prompt_token_ids"], "prompt_token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if not isinstance(content, list) or len(content) != len(ids):
            raise EngineAnswerError("choices[0].logprobs.content is not one entry per completion token")
        lps = [c.get("logprob") if isinstance(c, dict) else None for c in content]
        if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in lps):
            raise EngineAnswerError("a logprob is not a number")
        ed = ans["nvext"]["engine_data"]
        versions = _ints(ed["policy_versions"], "nvext.engine_data.policy_versions")
        if not versions:
            raise EngineAnswerError("nvext.engine_data.policy_versions is empty")
        return Rollout(
            prompt,
            ids,
            [float(x) for x in lps if x is not None],
            versions,
            str(ed.get("replica_id", "")),
            str(ed.get("snapshot_identity", "")),
            url,
        )
    except EngineAnswerError as e:
        raise EngineAnswerError(f"engine {url}: {e}") from None
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise EngineAnswerError(f"engine {url}: the answer lacks {e!s} or it has the wrong type") from None


class EnginePool:
    """The engines rollouts come from (base URLs such as ``http://10.0.0.5:8000``).

    ``timeout`` (s) bounds one request; ``workers`` requests run at once (default two per engine).
    """

    def __init__(self, urls: Sequence[str], *, timeout: float = 120.0, workers: int | None = None) -> None:
        if not urls:
            raise ValueError("no engine URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self._http = httpx.Client(timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=workers or 2 * len(self.urls), thread_name_prefix="rollout")

    def close(self) -> None:
        """Close the HTTP connections and the request threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def served_version(self, url: str) -> int | None:
        """The policy version the engine at ``url`` serves (``GET /health``); None while it loads,
        is unreachable or answers something else."""
        try:
            r = self._http.get(url + "/health", timeout=5.0)
            v = r.json().get("policy_version") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def wait_serving(self, min_version: int, timeout: float, poll_s: float = 0.05) -> list[str]:
        """The engines serving ``min_version`` or later, once there is at least one (polled every
        ``poll_s`` s). TimeoutError naming every engine's version after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            served = {u: self.served_version(u) for u in self.urls}
            ok = [u for u, v in served.items() if v is not None and v >= min_version]
            if ok:
                return ok
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no engine serves policy version {min_version} or later after {timeout} s (served: {served})"
                )
            time.sleep(poll_s)

    def complete(
        self,
        url: str,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> Rollout:
        """One rollout from the engine at ``url``; EngineAnswerError for an error status or a
        malformed answer, httpx.HTTPError when it cannot be reached."""
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": True,
            "nvext": {"extra_fields": ["engine_data"]},
        }
        if seed is not None:
            body["seed"] = seed
        r = self._http.post(url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise EngineAnswerError(f"engine {url}: HTTP {r.status_code}: {r.text[:200]!r}")
        try:
            ans = r.json()
        except ValueError:
            raise EngineAnswerError(f"engine {url}: the answer is not JSON") from None
        return parse_answer(url, ans)

    def map(self, jobs: Sequence[Callable[[], Rollout]]) -> list[Rollout]:
        """Run ``jobs`` (each one rollout) on the request threads; results in order; the first
        error is raised."""
        return [f.result() for f in [self._pool.submit(j) for j in jobs]]
