"""Registry pulls (c2jax.rl.sandbox.registry, `c2jax images pull / list`) against a local v2 registry served from
OCI layouts built in the test: bearer-token auth, blob redirects to another host:port without the
Authorization header, multi-platform indexes, digest-pinned references, Docker media types, and the failures
(404, refused credentials, a corrupt blob, no manifest for the platform) that must name the reference and
leave nothing in the store. Docker's reference rules as golden cases."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_oci import CONFIG, EXPECTED, LAYER1, LAYER2, make_docker_save, make_layout, tree

from c2jax.cli import main
from c2jax.rl.sandbox.oci import ImageError, find_in_store, load_image, read_image_config, store_name
from c2jax.rl.sandbox.registry import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    MANIFEST_ACCEPT,
    OCI_INDEX,
    OCI_MANIFEST,
    Reference,
    RegistryError,
    parse_reference,
    pull,
    stored_images,
)

HEX = "0123456789abcdef" * 4
TOKEN = "t0ken-for-demo"


# ------------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("text, expected", [
    ("ubuntu", ("registry-1.docker.io", "library/ubuntu", "latest", None)),
    ("ubuntu:22.04", ("registry-1.docker.io", "library/ubuntu", "22.04", None)),
    ("docker.io/foo", ("registry-1.docker.io", "library/foo", "latest", None)),
    ("index.docker.io/foo/bar:1", ("registry-1.docker.io", "foo/bar", "1", None)),
    ("foo/bar", ("registry-1.docker.io", "foo/bar", "latest", None)),
    ("ghcr.io/org/img:v1", ("ghcr.io", "org/img", "v1", None)),
    ("quay.io/x/y", ("quay.io", "x/y", "latest", None)),
    (f"localhost:5000/a/b@sha256:{HEX}", ("localhost:5000", "a/b", None, f"sha256:{HEX}")),
    (f"localhost/a:t@sha256:{HEX}", ("localhost", "a", "t", f"sha256:{HEX}")),
    ("127.0.0.1:5000/x__y/z-1.2", ("127.0.0.1:5000", "x__y/z-1.2", "latest", None)),
    ("localhost:5000", ("registry-1.docker.io", "library/localhost", "5000", None)),  # a tag, as in Docker
    ("[::1]:5000/img", ("[::1]:5000", "img", "latest", None)),
])
def test_parse_reference_follows_dockers_rules(text, expected):
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected
    assert parse_reference(str(ref)) == ref


@pytest.mark.parametrize("text, why", [
    ("", "empty"), ("Ubuntu", "must be lowercase"), ("org/Img:v1", "must be lowercase"),
    ("ubuntu@sha256:abc", "malformed digest"), (f"ubuntu@md5:{HEX}", "unsupported digest"),
    ("ubuntu:", "invalid tag"), ("ghcr.io/", "no repository name"), ("a//b", "invalid repository name"),
    (HEX, "image ID"), ("ubuntu latest", "whitespace"),
])
def test_bad_references_are_refused_with_the_reference(text, why):
    with pytest.raises(ValueError, match=re.escape(repr(text)) + ".*" + why):
        parse_reference(text)


# ------------------------------------------------------------------------------------------- a local registry
class Registry:
    """A v2 registry on 127.0.0.1 with the manifest and blob endpoints, optionally behind a bearer token (whose
    token endpoint may want basic credentials), optionally redirecting blobs to a second server on another port
    (object storage, which refuses a request carrying Authorization, as S3 does)."""

    def __init__(self, *, token: bool = False, basic: tuple[str, str] | None = None, redirect: bool = False):
        self.token, self.basic, self.redirect = token, basic, redirect
        self.manifests: dict[tuple[str, str], tuple[str, bytes]] = {}  # (repo, tag or digest) -> (type, bytes)
        self.blobs: dict[str, bytes] = {}
        self.corrupt: set[str] = set()
        self.fail_once: set[str] = set()  # blobs answered 503 the first time
        self.log: list[tuple[str, str, dict]] = []  # (server, path, headers)
        self._servers = []
        self.port = self._serve("registry", self._registry_get)
        self.storage_port = self._serve("storage", self._storage_get) if redirect else None
        self.host = f"127.0.0.1:{self.port}"

    def _serve(self, name, get):
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                registry.log.append((name, self.path, dict(self.headers)))
                status, headers, body = get(self)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a download the client gave up on

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        self._servers.append(server)
        return server.server_address[1]

    def close(self):
        for s in self._servers:
            s.shutdown()
            s.server_close()

    @staticmethod
    def _error(status, code, message, headers=None):
        return status, {"Content-Type": "application/json", **(headers or {})}, \
            json.dumps({"errors": [{"code": code, "message": message}]}).encode()

    def _blob_bytes(self, digest):
        data = self.blobs[digest]
        return data[:-1] + bytes([data[-1] ^ 1]) if digest in self.corrupt else data

    def _registry_get(self, req):
        url = urllib.parse.urlsplit(req.path)
        if url.path == "/token":
            query = urllib.parse.parse_qs(url.query)
            if query.get("service") != ["demo-registry"] or not query.get("scope", [""])[0].endswith(":pull"):
                return self._error(400, "DENIED", f"bad token request {url.query}")
            if self.basic is not None:
                expected = "Basic " + base64.b64encode(":".join(self.basic).encode()).decode()
                if req.headers.get("Authorization") != expected:
                    return self._error(401, "UNAUTHORIZED", "incorrect username or password")
            return 200, {"Content-Type": "application/json"}, json.dumps({"token": TOKEN}).encode()
        m = re.fullmatch(r"/v2/(.+)/(manifests|blobs|redirected)/([^/]+)", url.path)
        if not m:
            return self._error(404, "NOT_FOUND", url.path)
        repo, kind, version = m.groups()
        if self.token and req.headers.get("Authorization") != f"Bearer {TOKEN}":
            challenge = (f'Bearer realm="http://{self.host}/token",service="demo-registry",'
                         f'scope="repository:{repo}:pull"')
            return self._error(401, "UNAUTHORIZED", "authentication required", {"WWW-Authenticate": challenge})
        if kind == "manifests":
            if (repo, version) not in self.manifests:
                return self._error(404, "MANIFEST_UNKNOWN", f"manifest unknown: {version}")
            media_type, body = self.manifests[repo, version]
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            return 200, {"Content-Type": media_type, "Docker-Content-Digest": digest}, body
        if version not in self.blobs:
            return self._error(404, "BLOB_UNKNOWN", f"blob unknown: {version}")
        if version in self.fail_once:
            self.fail_once.discard(version)
            return self._error(503, "UNAVAILABLE", "try again")
        if self.redirect and kind == "blobs":  # first to another path of this registry, then off-host
            return 307, {"Location": f"/v2/{repo}/redirected/{version}"}, b""
        if self.redirect:
            location = f"http://127.0.0.1:{self.storage_port}/store/{version.split(':')[1]}?X-Amz-Signature=ab"
            return 302, {"Location": location}, b""
        return 200, {"Content-Type": "application/octet-stream"}, self._blob_bytes(version)

    def _storage_get(self, req):
        if req.headers.get("Authorization"):
            return 400, {}, b"InvalidArgument: Only one auth mechanism allowed"
        digest = "sha256:" + urllib.parse.urlsplit(req.path).path.rsplit("/", 1)[1]
        if digest not in self.blobs:
            return 404, {}, b"NoSuchKey"
        return 200, {"Content-Type": "application/octet-stream"}, self._blob_bytes(digest)

    # ------------------------------------------------------------------ content
    def add_layout(self, repo: str, layout: Path) -> dict:
        """Every blob of `layout`; each of its manifests by digest. Its index.json's descriptors."""
        for blob in (layout / "blobs" / "sha256").iterdir():
            data = blob.read_bytes()
            self.blobs["sha256:" + blob.name] = data
            try:
                doc = json.loads(data)
            except ValueError:
                continue
            if isinstance(doc, dict) and "layers" in doc:
                self.manifests[repo, "sha256:" + blob.name] = (doc["mediaType"], data)
        return json.loads((layout / "index.json").read_text())["manifests"]

    def tag(self, repo: str, tag: str, media_type: str, body: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self.manifests[repo, tag] = self.manifests[repo, digest] = (media_type, body)
        return digest


@pytest.fixture
def registry():
    servers = []

    def make(**kw) -> Registry:
        servers.append(Registry(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The test image (linux/amd64) and an arm64 one with a different tree, as OCI layouts, and the tree the
    amd64 one unpacks to directly."""
    root = tmp_path_factory.mktemp("layouts")
    amd = make_layout(root / "amd64", layers=[LAYER1, LAYER2])
    arm_cfg = {**CONFIG, "architecture": "arm64", "variant": "v8"}
    arm = make_layout(root / "arm64", layers=[LAYER1 + [("etc/arch", "file", "arm64\n")]], config=arm_cfg)
    direct = load_image(amd, root / "cache")
    assert tree(direct.rootfs) == EXPECTED
    return {"amd64": amd, "arm64": arm, "direct": direct}


def _manifest(layout: Path) -> tuple[dict, bytes]:
    desc = json.loads((layout / "index.json").read_text())["manifests"][0]
    return desc, (layout / "blobs" / "sha256" / desc["digest"].split(":")[1]).read_bytes()


def _serve_single(reg: Registry, layout: Path, repo="demo/app", tag="v1") -> str:
    reg.add_layout(repo, layout)
    desc, body = _manifest(layout)
    reg.tag(repo, tag, OCI_MANIFEST, body)
    return desc["digest"]


def _serve_multi(reg: Registry, layouts, repo="demo/multi", tag="v1", media_type=OCI_INDEX) -> tuple[str, dict]:
    descs = {}
    for arch in ("arm64", "amd64"):  # arm64 first: the pick is by platform, not position
        (desc,) = reg.add_layout(repo, layouts[arch])
        desc["platform"] = {"os": "linux", "architecture": arch, **({"variant": "v8"} if arch == "arm64" else {})}
        descs[arch] = desc
    attestation = {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "0" * 64, "size": 2,
                   "platform": {"os": "unknown", "architecture": "unknown"}}
    index = {"schemaVersion": 2, "mediaType": media_type, "manifests": [descs["arm64"], attestation, descs["amd64"]]}
    return reg.tag(repo, tag, media_type, json.dumps(index).encode()), descs


def _pulled_tree(path: Path, cache: Path) -> dict:
    return tree(load_image(path, cache).rootfs)


def _left_in(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


# ------------------------------------------------------------------------------------------- pulls
def test_pull_with_token_auth_and_redirected_blobs(registry, layouts, tmp_path):
    reg = registry(token=True, redirect=True)
    digest = _serve_single(reg, layouts["amd64"])
    ref = f"{reg.host}/demo/app:v1"
    store = tmp_path / "store"
    path = pull(ref, store)
    assert path == store / store_name(ref) and find_in_store(ref, store) == path
    assert _left_in(store) == [store_name(ref)]  # no staging left over
    image = load_image(path, tmp_path / "cache")
    assert image.digest == digest == layouts["direct"].digest
    assert tree(image.rootfs) == tree(layouts["direct"].rootfs) == EXPECTED
    assert image.config == layouts["direct"].config
    index = json.loads((path / "index.json").read_text())
    (desc,) = index["manifests"]
    assert desc["digest"] == digest and desc["mediaType"] == OCI_MANIFEST
    assert desc["annotations"] == {"org.opencontainers.image.ref.name": ref}
    assert desc["platform"] == {"os": "linux", "architecture": "amd64"}  # from the config of a single manifest

    # one 401, a token, then authorized requests; the accept header names all four manifest types
    registry_paths = [(p, h.get("Authorization")) for s, p, h in reg.log if s == "registry"]
    assert registry_paths[0] == ("/v2/demo/app/manifests/v1", None)
    assert registry_paths[1][0].startswith("/token?") and "scope=repository%3Ademo%2Fapp%3Apull" in registry_paths[1][0]
    assert all(auth == f"Bearer {TOKEN}" for p, auth in registry_paths[2:])
    accept = next(h["Accept"] for s, p, h in reg.log if "/manifests/" in p)
    assert accept == MANIFEST_ACCEPT
    assert all(t in accept for t in (OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
    # every blob (config + 2 layers) came through both redirects, from storage, without the registry's token
    assert sum("/redirected/" in p for p, _ in registry_paths) == 3
    storage = [h for s, p, h in reg.log if s == "storage"]
    assert len(storage) == 3 and not any("Authorization" in h for h in storage)

    # a second pull is a lookup; force pulls again
    before = len(reg.log)
    assert pull(ref, store) == path and len(reg.log) == before
    assert pull(ref, store, force=True) == path and len(reg.log) > before
    assert _left_in(store) == [store_name(ref)]
    assert _pulled_tree(path, tmp_path / "cache2") == EXPECTED


def test_multi_platform_index_picks_the_platform(registry, layouts, tmp_path):
    reg = registry()
    index_digest, descs = _serve_multi(reg, layouts)
    ref = f"{reg.host}/demo/multi:v1"
    path = pull(ref, tmp_path / "store")
    (desc,) = json.loads((path / "index.json").read_text())["manifests"]
    assert desc["digest"] == descs["amd64"]["digest"] and desc["platform"] == {"os": "linux", "architecture": "amd64"}
    assert _pulled_tree(path, tmp_path / "c1") == tree(layouts["direct"].rootfs)
    assert not any(descs["arm64"]["digest"] in p for _, p, _ in reg.log)  # nothing of the other platform fetched

    arm = pull(ref, tmp_path / "arm-store", platform="linux/arm64")
    (desc,) = json.loads((arm / "index.json").read_text())["manifests"]
    assert desc["platform"]["architecture"] == "arm64"
    assert _pulled_tree(arm, tmp_path / "c2")["etc/arch"] == "arm64\n"
    assert pull(ref, tmp_path / "arm-v8", platform=("linux", "arm64", "v8")).is_dir()

    store = tmp_path / "s390x"
    with pytest.raises(RegistryError, match=rf"{re.escape(ref)}: .*/manifests/v1: no linux/s390x manifest "
                                            r"\(the index has linux/amd64, linux/arm64/v8, unknown/unknown\)"):
        pull(ref, store, platform="linux/s390x")
    assert _left_in(store) == []


def test_digest_pinned_references(registry, layouts, tmp_path):
    reg = registry(token=True)
    index_digest, descs = _serve_multi(reg, layouts)
    amd = descs["amd64"]["digest"]
    by_manifest = f"{reg.host}/demo/multi@{amd}"
    path = pull(by_manifest, tmp_path / "store")
    assert path.name == store_name(by_manifest) and read_image_config(path)[0] == amd
    assert any(p == f"/v2/demo/multi/manifests/{amd}" for _, p, _ in reg.log)
    # pinned to the index: the index is checked against the pin, then amd64 picked from it
    by_index = f"{reg.host}/demo/multi:v1@{index_digest}"
    assert read_image_config(pull(by_index, tmp_path / "store"))[0] == amd

    # the registry serves other bytes than the pin names: refused, nothing kept
    wrong = "sha256:" + "e" * 64
    reg.manifests["demo/multi", wrong] = reg.manifests["demo/multi", amd]
    store = tmp_path / "pinned-wrong"
    with pytest.raises(RegistryError, match=rf"/manifests/{wrong}: the manifest does not match its digest {wrong} "
                                            rf"\(got {amd}\)"):
        pull(f"{reg.host}/demo/multi@{wrong}", store)
    assert _left_in(store) == []


def test_docker_media_types_are_kept_and_unpack(registry, layouts, tmp_path):
    reg = registry()
    reg.add_layout("demo/docker", layouts["amd64"])
    _, body = _manifest(layouts["amd64"])
    manifest = json.loads(body)
    manifest["mediaType"] = DOCKER_MANIFEST
    manifest["config"]["mediaType"] = "application/vnd.docker.container.image.v1+json"
    for layer in manifest["layers"]:
        gz = layer["mediaType"].endswith("+gzip")
        layer["mediaType"] = "application/vnd.docker.image.rootfs.diff.tar" + (".gzip" if gz else "")
    mbody = json.dumps(manifest).encode()
    mdigest = reg.tag("demo/docker", "m", DOCKER_MANIFEST, mbody)
    listing = {"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": [
        {"mediaType": DOCKER_MANIFEST, "digest": mdigest, "size": len(mbody),
         "platform": {"os": "linux", "architecture": "amd64"}}]}
    reg.tag("demo/docker", "list", DOCKER_LIST, json.dumps(listing).encode())
    path = pull(f"{reg.host}/demo/docker:list", tmp_path / "store")
    (desc,) = json.loads((path / "index.json").read_text())["manifests"]
    assert desc["mediaType"] == DOCKER_MANIFEST and desc["digest"] == mdigest
    image = load_image(path, tmp_path / "cache")
    assert image.digest == mdigest and tree(image.rootfs) == EXPECTED


def test_failures_name_the_reference_url_and_cause_and_leave_nothing(registry, layouts, tmp_path, monkeypatch):
    monkeypatch.delenv("C2JAX_REGISTRY_AUTH", raising=False)
    reg = registry(redirect=True)
    _serve_single(reg, layouts["amd64"])
    store = tmp_path / "store"

    missing = f"{reg.host}/demo/missing:v1"
    with pytest.raises(RegistryError, match=rf"cannot pull {re.escape(missing)}: http://{reg.host}"
                                            r"/v2/demo/missing/manifests/v1: not found: HTTP 404.*MANIFEST_UNKNOWN"):
        pull(missing, store)

    ref = f"{reg.host}/demo/app:v1"
    _, body = _manifest(layouts["amd64"])
    layer = json.loads(body)["layers"][1]["digest"]
    reg.corrupt.add(layer)
    with pytest.raises(RegistryError, match=rf"cannot pull {re.escape(ref)}: http://{reg.host}/v2/demo/app/blobs/"
                                            rf"{layer}: blob does not match its digest {layer} \(got sha256:"):
        pull(ref, store)
    assert isinstance(RegistryError("x"), ImageError)
    assert _left_in(store) == [] and find_in_store(ref, store) is None
    # a server error on a blob is tried again
    reg.corrupt.clear()
    reg.fail_once.add(layer)
    assert _pulled_tree(pull(ref, store), tmp_path / "cache") == EXPECTED
    assert sum(p == f"/v2/demo/app/blobs/{layer}" for _, p, _ in reg.log) == 3  # corrupt, 503, then served
    store = tmp_path / "store2"

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}/demo/app"
    with pytest.raises(RegistryError, match=rf"cannot pull {closed}: http://{closed.replace('/demo', '/v2/demo')}"
                                            r"/manifests/latest: registry unreachable"):
        pull(closed, store)
    assert _left_in(store) == []


def test_token_service_credentials(registry, layouts, tmp_path, monkeypatch):
    monkeypatch.delenv("C2JAX_REGISTRY_AUTH", raising=False)
    reg = registry(token=True, basic=("alice", "s3cret"))
    _serve_single(reg, layouts["amd64"])
    ref = f"{reg.host}/demo/app:v1"
    store = tmp_path / "store"
    with pytest.raises(RegistryError, match=rf"cannot pull {re.escape(ref)}: http://{reg.host}/token\?.*"
                                            r"access denied: HTTP 401.*incorrect username or password.*"
                                            r"needs credentials \(set \$C2JAX_REGISTRY_AUTH"):
        pull(ref, store)
    monkeypatch.setenv("C2JAX_REGISTRY_AUTH", "alice:wrong")
    with pytest.raises(RegistryError, match=r"access denied: HTTP 401.*the credentials of \$C2JAX_REGISTRY_AUTH "
                                            "were refused"):
        pull(ref, store)
    assert _left_in(store) == []
    # the per-registry variable wins over the global one
    monkeypatch.setenv(f"C2JAX_REGISTRY_AUTH_127_0_0_1_{reg.port}", "alice:s3cret")
    assert _pulled_tree(pull(ref, store), tmp_path / "cache") == EXPECTED


# ------------------------------------------------------------------------------------------- the command
def test_images_pull_and_list_commands(registry, layouts, tmp_path, monkeypatch, capsys):
    reg = registry(token=True)
    digest = _serve_single(reg, layouts["amd64"])
    ref = f"{reg.host}/demo/app:v1"
    store = tmp_path / "store"
    monkeypatch.delenv("C2JAX_IMAGE_STORE", raising=False)
    assert main(["images", "pull", ref]) == 2
    assert "$C2JAX_IMAGE_STORE" in capsys.readouterr().err

    assert main(["images", "pull", ref, "--store", str(store)]) == 0
    out = capsys.readouterr()
    assert f"{ref}: {digest} -> {store / store_name(ref)}" in out.out
    assert len(out.err.splitlines()) == 3  # a line per blob: config and two layers
    assert main(["images", "pull", ref, "--store", str(store)]) == 0
    assert "already in the store" in capsys.readouterr().out
    assert main(["images", "pull", f"{reg.host}/demo/nope", "--store", str(store)]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["images", "pull", "Bad/Ref", "--store", str(store)]) == 2
    assert "must be lowercase" in capsys.readouterr().err

    make_docker_save(store / "demo_latest.tar", layers=[LAYER1])  # a `docker save` archive beside it
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(store))
    assert main(["images", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(rf"{re.escape(ref)}\s+{digest}\s+{re.escape(store_name(ref))}", lines[0])
    assert re.fullmatch(r"demo:latest\s+sha256:[0-9a-f]{64}\s+demo_latest\.tar", lines[1])
    assert [i.reference for i in stored_images(store)] == [ref, "demo:latest"]


def test_reference_str_round_trip():
    ref = Reference("registry-1.docker.io", "library/ubuntu", "latest", None)
    assert str(ref) == "registry-1.docker.io/library/ubuntu:latest" and ref.version == "latest"
    pinned = parse_reference(f"ubuntu@sha256:{HEX}")
    assert pinned.version == f"sha256:{HEX}" and pinned.tag is None

