"""A Hugging Face Hub stand-in on loopback, for huggingface_hub's real client.

It speaks the part of the Hub protocol that ``create_repo``, ``create_commit`` (preupload, the
LFS batch API with basic transfers, the NDJSON commit), ``repo_info``, ``list_repo_tree`` and
``snapshot_download`` use, with Xet disabled (``HF_HUB_DISABLE_XET=1``): the Xet CAS protocol is
not something a test server can speak. Every request must carry the expected bearer token; every
request is logged so tests can check exactly what was sent. Knobs: ``fail_lfs_puts`` breaks the
next N LFS uploads midway (an interrupted upload); ``tamper(repo, path, data)`` changes a stored
file behind the client's back; ``publish(repo, files)`` makes a repo holding exactly ``files``
without an upload; ``commit_reply_overrides`` makes the commit answer hostile (``{token}``,
``{commit}`` and ``{base}`` in a value become the caller's token, the new commit id and the
server's own URL).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator
from urllib.parse import parse_qs, unquote, urlparse

LFS_MIN_BYTES = 1024  # smaller files are committed inline ("regular"), like small text on the Hub


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> tree
    lfs_paths: dict[str, dict] = field(default_factory=dict)  # commit -> {path: sha256 at upload}


class HubState:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content
        self.log: list[tuple[str, str]] = []
        self.fail_lfs_puts = 0  # the next N uploads break midway
        self.fail_oids: set[str] = set()  # uploads of these objects always break midway
        self.commit_reply_overrides: dict[str, str] = {}
        self.lock = threading.Lock()
        self._n = 0

    def sign(self, oid: str) -> str:
        return hashlib.sha256(f"{self.token}:{oid}".encode()).hexdigest()[:32]

    def new_commit_id(self) -> str:
        self._n += 1
        return hashlib.sha1(f"commit-{self._n}".encode()).hexdigest()

    def publish(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> str:
        """A repo whose main branch holds exactly ``files``, large ones as LFS objects, as an upload
        leaves it; returns the commit id."""
        with self.lock:
            repo = Repo(private=private)
            commit = self.new_commit_id()
            repo.commits[commit] = dict(files)
            repo.lfs_paths[commit] = {}
            for path, data in files.items():
                if len(data) >= LFS_MIN_BYTES:
                    oid = hashlib.sha256(data).hexdigest()
                    self.lfs[oid] = data
                    repo.lfs_paths[commit][path] = oid
            repo.branches["main"] = commit
            self.repos[repo_id] = repo
        return commit

    def tamper(self, repo_id: str, path: str, data: bytes, branch: str = "main") -> None:
        repo = self.repos[repo_id]
        tree = repo.commits[repo.branches[branch]]
        tree[path] = data


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState

    def log_message(self, *args) -> None:  # quiet
        pass

    # --- plumbing ---------------------------------------------------------------------------
    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj, headers: dict | None = None, content_type: str = "application/json"):
        self._send(code, json.dumps(obj).encode(), headers, content_type)

    def _error(self, code: int, message: str, error_code: str | None = None):
        headers = {"X-Error-Message": message}
        if error_code:
            headers["X-Error-Code"] = error_code
        self._json(code, {"error": message}, headers)

    def _body(self) -> bytes:
        if not hasattr(self, "_cached_body"):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()  # CRLF after each chunk
                self._cached_body = b"".join(chunks)
            else:
                length = int(self.headers.get("Content-Length") or 0)
                self._cached_body = self.rfile.read(length) if length else b""
        return self._cached_body

    def _base(self) -> str:
        return f"http://{self.headers['Host']}"

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.state.token}"

    def _dispatch(self):
        url = urlparse(self.path)
        path = unquote(url.path)
        self.state.log.append((self.command, path))
        self.__dict__.pop("_cached_body", None)  # one handler serves every request of a connection
        if self.command == "POST":
            self._body()  # consumed up front, so a handler that ignores it keeps the connection sane
        presigned = path.startswith("/lfs-upload/")  # like S3 URLs: the signature is the credential
        if not presigned and not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        for method, prefix, handler in _ROUTES:
            if self.command == method and path.startswith(prefix):
                return handler(self, path[len(prefix):], parse_qs(url.query))
        self._error(404, f"no route for {self.command} {path}")

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch

    # --- repos -----------------------------------------------------------------------------
    def _repo(self, repo_id: str):
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "Repository not found", "RepoNotFound")
        return repo

    def create_repo(self, _rest, _q):
        req = json.loads(self._body())
        repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
        with self.state.lock:
            if repo_id in self.state.repos:
                return self._json(409, {"error": "You already created this model repo",
                                        "url": f"{self._base()}/{repo_id}"},
                                  {"X-Error-Message": "You already created this model repo"})
            repo = Repo(private=bool(req.get("private")) or req.get("visibility") == "private")
            first = self.state.new_commit_id()
            repo.commits[first] = {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}
            repo.lfs_paths[first] = {}
            repo.branches["main"] = first
            self.state.repos[repo_id] = repo
        self._json(200, {"url": f"{self._base()}/{repo_id}", "name": repo_id})

    def models_api(self, rest: str, q):
        # {org}/{name}[/revision/{rev} | /tree/{rev}[/path] | /preupload/{rev} | /commit/{rev} | /branch/{b}]
        parts = rest.split("/")
        repo_id = "/".join(parts[:2])
        tail = parts[2:]
        repo = self._repo(repo_id)
        if repo is None:
            return
        if not tail or tail[0] == "revision":
            rev = tail[1] if len(tail) > 1 else "main"
            commit = repo.branches.get(rev, rev if rev in repo.commits else None)
            if commit is None:
                return self._error(404, "Invalid rev id", "RevisionNotFound")
            tree = repo.commits[commit]
            return self._json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                                    "siblings": [{"rfilename": p} for p in sorted(tree)]})
        if tail[0] == "tree":
            commit = repo.branches.get(tail[1], tail[1])
            if commit not in repo.commits:
                return self._error(404, "Invalid rev id", "RevisionNotFound")
            tree = repo.commits[commit]
            entries = []
            for p in sorted(tree):
                data = tree[p]
                entry = {"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data)}
                if p in repo.lfs_paths[commit]:
                    entry["lfs"] = {"oid": repo.lfs_paths[commit][p], "size": len(data), "pointerSize": 134}
                entries.append(entry)
            return self._json(200, entries)
        if tail[0] == "preupload" and self.command == "POST":
            req = json.loads(self._body())
            files = [{"path": f["path"], "uploadMode": "lfs" if f["size"] >= LFS_MIN_BYTES else "regular",
                      "shouldIgnore": False} for f in req["files"]]
            return self._json(200, {"files": files, "commitOid": repo.branches.get(tail[1])})
        if tail[0] == "commit" and self.command == "POST":
            return self.commit(repo_id, repo, "/".join(tail[1:]))
        if tail[0] == "branch" and self.command == "POST":
            branch = "/".join(tail[1:])
            with self.state.lock:
                if branch in repo.branches:
                    return self._error(409, "Reference already exists")
                repo.branches[branch] = repo.branches["main"]
            return self._json(200, {})
        self._error(404, f"unknown models API call {rest}")

    def commit(self, repo_id: str, repo: Repo, rev: str):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        with self.state.lock:
            parent = repo.branches.get(rev)
            if parent is None:
                return self._error(404, "Invalid rev id", "RevisionNotFound")
            tree = dict(repo.commits[parent])
            lfs_paths = dict(repo.lfs_paths[parent])
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "file":
                    tree[value["path"]] = base64.b64decode(value["content"])
                    lfs_paths.pop(value["path"], None)
                elif key == "lfsFile":
                    data = self.state.lfs.get(value["oid"])
                    if data is None:
                        return self._error(400, f"LFS object {value['oid']} was never uploaded")
                    tree[value["path"]] = data
                    lfs_paths[value["path"]] = value["oid"]
                elif key == "deletedFile":
                    tree.pop(value["path"], None)
            commit = self.state.new_commit_id()
            repo.commits[commit] = tree
            repo.lfs_paths[commit] = lfs_paths
            repo.branches[rev] = commit
        reply = {"commitUrl": f"{self._base()}/{repo_id}/commit/{commit}", "commitOid": commit,
                 "pullRequestUrl": None}
        for key, value in self.state.commit_reply_overrides.items():
            reply[key] = (value.replace("{token}", self.state.token).replace("{commit}", commit)
                          .replace("{base}", self._base()))
        self._json(200, reply)

    def validate_yaml(self, _rest, _q):
        import yaml

        req = json.loads(self._body())
        content = req.get("content", "")
        if content.startswith("---"):
            try:
                yaml.safe_load(content.split("---")[1])
            except yaml.YAMLError as e:
                return self._error(400, f"invalid YAML front matter: {e}")
        self._json(200, {"errors": [], "warnings": []})

    # --- LFS ---------------------------------------------------------------------------------
    def lfs_batch(self, repo_id: str):
        req = json.loads(self._body())
        host = self._base()
        objects = []
        for obj in req["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.state.lfs:  # stored objects need no upload: resumption
                entry["actions"] = {"upload": {"href": f"{host}/lfs-upload/{obj['oid']}?sig={self.state.sign(obj['oid'])}"}}
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def lfs_put(self, oid: str, q):
        length = int(self.headers.get("Content-Length") or 0)
        if q.get("sig", [""])[0] != self.state.sign(oid):
            self.rfile.read(length)
            return self._error(403, "bad upload signature")
        with self.state.lock:
            fail = self.state.fail_lfs_puts > 0 or oid in self.state.fail_oids
            if self.state.fail_lfs_puts > 0:
                self.state.fail_lfs_puts -= 1
        if fail:
            self.rfile.read(length // 2)
            self.close_connection = True
            return self._error(500, "connection dropped mid-upload")
        data = self.rfile.read(length)
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, "sha256 mismatch")
        self.state.lfs[oid] = data
        self._send(200)

    # --- downloads ----------------------------------------------------------------------------
    def resolve(self, repo_id: str, rev: str, path: str):
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.branches.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            return self._error(404, "Invalid rev id", "RevisionNotFound")
        tree = repo.commits[commit]
        if path not in tree:
            return self._error(404, "Entry not found", "EntryNotFound")
        data = tree[path]
        headers = {"X-Repo-Commit": commit}
        if path in repo.lfs_paths[commit]:
            etag = repo.lfs_paths[commit][path]  # as uploaded, even if the bytes were changed since
            headers.update({"ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        else:
            headers["ETag"] = f'"{git_blob_sha1(data)}"'
        self._send(200, data, headers, content_type="application/octet-stream")


def _repo_file_route(handler: _Handler, rest: str, q):
    # /{org}/{name}.git/info/lfs/objects/batch  or  /{org}/{name}/resolve/{rev}/{path}
    if ".git/info/lfs/objects/batch" in rest:
        return handler.lfs_batch(rest.split(".git/")[0])
    parts = rest.split("/")
    if len(parts) >= 5 and parts[2] == "resolve":
        return handler.resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
    handler._error(404, f"no route for {handler.command} /{rest}")


_ROUTES = [
    ("POST", "/api/repos/create", _Handler.create_repo),
    ("POST", "/api/validate-yaml", _Handler.validate_yaml),
    ("GET", "/api/models/", _Handler.models_api),
    ("POST", "/api/models/", _Handler.models_api),
    ("PUT", "/lfs-upload/", _Handler.lfs_put),
    ("GET", "/", _repo_file_route),
    ("HEAD", "/", _repo_file_route),
    ("POST", "/", _repo_file_route),
]


class HubServer:
    """``with HubServer(token) as hub: hub.endpoint`` serves on 127.0.0.1, a free port."""

    def __init__(self, token: str):
        self.state = HubState(token)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def hub_on_loopback(monkeypatch, tmp_path, token: str) -> Iterator[HubServer]:
    """A :class:`HubServer` that huggingface_hub in this process talks to, with ``token`` as the
    user's token and a private Hub home and cache under ``tmp_path``."""
    import huggingface_hub.constants as constants

    # The stand-in speaks the LFS protocol, not Xet's content-addressed store.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with HubServer(token) as server:
        yield server
