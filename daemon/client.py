"""The CLI's HTTP client: the daemon is reached over its API, as Ollama's CLI does."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


class ClientError(RuntimeError):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Client:
    def __init__(self, base_url: str, timeout: float | None = None) -> None:
        self.base_url = base_url
        self._http = httpx.Client(base_url=base_url, timeout=httpx.Timeout(timeout, connect=5.0))

    def close(self) -> None:
        self._http.close()

    def heartbeat(self) -> bool:
        try:
            return self._http.head("/", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _check(self, response: httpx.Response) -> None:
        if response.status_code >= 400:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            raise ClientError(str(message), response.status_code)

    def get(self, path: str) -> Any:
        response = self._http.get(path)
        self._check(response)
        return response.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = self._http.post(path, json=body)
        self._check(response)
        return response.json() if response.content else {}

    def upload_blob(self, file: Path) -> str:
        """Upload `file` as a blob unless the daemon has it (`HEAD` first, as Ollama's CLI);
        its digest."""
        sha = hashlib.sha256()
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
        digest = "sha256:" + sha.hexdigest()
        if self._http.head(f"/api/blobs/{digest}").status_code == 200:
            return digest
        with open(file, "rb") as f:
            self._check(self._http.post(f"/api/blobs/{digest}", content=f))
        return digest

    def delete(self, path: str, body: dict[str, Any]) -> None:
        response = self._http.request("DELETE", path, json=body)
        self._check(response)

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """NDJSON objects; an `error` line raises, as Ollama's clients do."""
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                self._check(response)
            for line in response.iter_lines():
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    raise ClientError(str(obj["error"]))
                yield obj
