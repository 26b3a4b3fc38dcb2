"""A stand-in for the Hugging Face Hub's HTTP API, as far as `genq push` drives it through the real
``huggingface_hub`` client (HF_ENDPOINT points the client here): create a repository, validate a
card's YAML, the preupload that says how each file goes up, and the commit that carries them.

Every file is answered "regular" at preupload (sent inside the commit, base64), so neither LFS nor
Xet storage is needed; a file the stand-in already holds is answered with its git blob id, which is
how the real Hub lets the client skip unchanged files. Requests are kept for the test to read.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml


def git_blob_id(data: bytes) -> str:
    """git's object id of a blob: what the Hub reports as a regular file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[list[str]] = field(default_factory=list)  # the paths each commit sent

    @property
    def sha(self) -> str:
        return hashlib.sha1(repr(sorted(self.files.items())).encode()).hexdigest()


class Handler(BaseHTTPRequestHandler):
    """The Hub's routes genq push reaches; the Hub it serves is ``self.server.hub``."""

    @property
    def hub(self) -> Hub:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.hub.requests.append(("GET", self.path, self.headers.get("Authorization")))
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts[:2] == ["api", "datasets"] and len(parts) >= 6 and parts[4] == "revision":
            repo = self.hub.repos.get(f"{parts[2]}/{parts[3]}")
            if repo is None:
                return self._json(404, {"error": "Repository not found"})
            return self._json(200, {"id": f"{parts[2]}/{parts[3]}", "sha": repo.sha, "private": repo.private})
        self._json(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        self.hub.requests.append(("POST", self.path, self.headers.get("Authorization")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts == ["api", "repos", "create"]:
            return self._create(json.loads(body))
        if parts == ["api", "validate-yaml"]:
            return self._validate(json.loads(body))
        if parts[:2] == ["api", "datasets"] and len(parts) >= 6:
            repo_id = f"{parts[2]}/{parts[3]}"
            repo = self.hub.repos.get(repo_id)
            if repo is None:
                return self._json(404, {"error": "Repository not found"})
            if parts[4] == "preupload":
                return self._preupload(repo, json.loads(body))
            if parts[4] == "commit":
                return self._commit(repo_id, repo, body)
        self._json(404, {"error": f"no route {self.path}"})

    def _create(self, data: dict) -> None:
        repo_id = f"{data['organization']}/{data['name']}"
        if data.get("type") != "dataset":
            return self._json(400, {"error": "genq pushes datasets only"})
        if repo_id in self.hub.repos:  # the client reads the url even from this answer (create_repo)
            url = f"{self.hub.url}/datasets/{repo_id}"
            return self._json(409, {"error": "You already created this dataset repo", "url": url})
        self.hub.repos[repo_id] = Repo(private=data.get("visibility") == "private")
        self._json(200, {"url": f"{self.hub.url}/datasets/{repo_id}", "name": repo_id})

    def _validate(self, data: dict) -> None:
        content = data["content"]
        if not content.startswith("---\n"):
            return self._json(200, {"errors": [], "warnings": [{"message": "empty metadata"}]})
        try:
            yaml.safe_load(content.split("---\n")[1])
        except yaml.YAMLError as exc:
            return self._json(400, {"errors": [{"message": str(exc)}]})
        self._json(200, {"errors": [], "warnings": []})

    def _preupload(self, repo: Repo, data: dict) -> None:
        files = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_id(repo.files[f["path"]]) if f["path"] in repo.files else None,
            }
            for f in data["files"]
        ]
        self._json(200, {"files": files, "commitOid": repo.sha})

    def _commit(self, repo_id: str, repo: Repo, body: bytes) -> None:
        if self.hub.refuse_commits:
            return self._json(403, {"error": "You don't have the rights to write to this repo"})
        sent = []
        for line in body.splitlines():
            entry = json.loads(line)
            if entry["key"] == "file":
                value = entry["value"]
                repo.files[value["path"]] = base64.b64decode(value["content"])
                sent.append(value["path"])
        repo.commits.append(sent)
        sha = repo.sha
        self._json(200, {"commitUrl": f"{self.hub.url}/datasets/{repo_id}/commit/{sha}", "commitOid": sha})

    def _json(self, status: int, data: Any) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


class Hub:
    """The stand-in, serving on 127.0.0.1 in a thread of the test process."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        self.refuse_commits = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Hub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
