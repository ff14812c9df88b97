"""HTTP calls to one vLLM OpenAI server: health, model list, LoRA load/unload, a completion.

Every error names the replica and carries the server's answer (status code and body).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from art_mega.errors import ReplicaHTTPError

DEFAULT_TIMEOUT_S = 60.0


class ReplicaClient:
    """Async calls to one replica's OpenAI-compatible server at `url` (http://HOST:PORT).

    `name` (the replica's process name, e.g. "vllm-0") appears in every error. `timeout_s`
    bounds each call in seconds. Use as an async context manager or call `aclose()`.
    """

    def __init__(self, name: str, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, trust_env=False)

    async def __aenter__(self) -> ReplicaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, what: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise ReplicaHTTPError(self.name, self.url, what, None, f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ReplicaHTTPError(self.name, self.url, what, response.status_code, response.text.strip())
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def prefix_cache_counts(self) -> tuple[float, float]:
        """(queried, hit) prompt tokens of the replica's prefix cache since it started, read from
        its `GET /metrics` (`replica.prefix_cache_counts`).

        Raises:
            ReplicaHTTPError: /metrics did not answer 200, or holds neither counter.
        """
        from art_mega.inference.replica import prefix_cache_counts

        text = await self._call("read its metrics", "GET", "/metrics")
        try:
            return prefix_cache_counts(str(text))
        except ValueError as exc:
            raise ReplicaHTTPError(self.name, self.url, "read its metrics", 200, str(exc)) from exc

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """True when `GET /health` answers 200 within `timeout_s` seconds; never raises."""
        try:
            response = await self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def model_ids(self) -> list[str]:
        """The names `GET /v1/models` lists: the base model and every loaded adapter."""
        reply = await self._call("listing models", "GET", "/v1/models")
        return [entry["id"] for entry in reply.get("data", [])]

    async def load_adapter(self, lora_name: str, lora_path: str, inplace: bool = False) -> None:
        """`POST /v1/load_lora_adapter`: serve the adapter directory `lora_path` as `lora_name`.

        `inplace` reloads a name that is already loaded (vLLM's `load_inplace`) instead of
        refusing it. Raises `ReplicaHTTPError` with the server's answer (404 for a path with
        no adapter, 400 for a name already loaded without `inplace`).
        """
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if inplace:
            body["load_inplace"] = True
        await self._call(
            f"loading adapter {lora_name} from {lora_path}", "POST", "/v1/load_lora_adapter", body
        )

    async def unload_adapter(self, lora_name: str) -> None:
        """`POST /v1/unload_lora_adapter`. Raises `ReplicaHTTPError` (404 for an unknown name)."""
        body = {"lora_name": lora_name}
        await self._call(f"unloading adapter {lora_name}", "POST", "/v1/unload_lora_adapter", body)

    async def sleep(self, level: int = 1) -> None:
        """`POST /sleep?level=LEVEL&mode=wait`: finish in-flight requests, then free the GPU.

        Level 1 offloads the weights (and loaded adapters) to CPU memory and discards the KV
        cache; `wake_up` brings them back. Needs a server started with `--enable-sleep-mode`
        and `VLLM_SERVER_DEV_MODE=1` (see `replica.vllm_argv`); others answer 404. Raises
        `ReplicaHTTPError`.
        """
        await self._call(f"sleeping (level {level})", "POST", f"/sleep?level={level}&mode=wait")

    async def wake_up(self) -> None:
        """`POST /wake_up`: reload what `sleep` freed. Raises `ReplicaHTTPError`, also when the
        server answers 200 but says it is not fully awake (`{"status": "sleeping"}`)."""
        reply = await self._call("waking up", "POST", "/wake_up")
        if isinstance(reply, dict) and reply.get("status", "awake") != "awake":
            raise ReplicaHTTPError(self.name, self.url, "waking up", 200, json.dumps(reply))

    async def complete(self, model: str, prompt: str, max_tokens: int = 1, **fields: Any) -> dict[str, Any]:
        """`POST /v1/completions` with greedy decoding unless `fields` say otherwise; the JSON reply."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **fields}
        return await self._call(f"completion with model {model}", "POST", "/v1/completions", body)
