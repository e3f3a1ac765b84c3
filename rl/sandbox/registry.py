"""Pulling images from an OCI / Docker registry into c2jax's image store (`c2jax images pull REF`).

`pull(reference, store)` speaks the OCI distribution API v2 with the standard library only: the manifest from
`/v2/<repository>/manifests/<tag or digest>` (OCI index / manifest, Docker manifest list / v2 manifest), the
platform's manifest of an index (linux/amd64 by default), then the config and every layer from
`/v2/<repository>/blobs/<digest>`, streamed to disk. Every blob is checked against the sha256 and size of its
descriptor, the manifest against the reference's pinned digest (`name@sha256:...`) or the registry's
`Docker-Content-Digest`. The image is written as an OCI image layout at `STORE/<store_name(reference)>`
(`oci.find_in_store` finds it; `oci.load_image` unpacks it): built in a staging directory of the store and
renamed into place, so a failed pull leaves nothing behind. Media types are kept as the registry serves them
(oci.py reads OCI and Docker ones alike).

References follow Docker's rules (`parse_reference`): `ubuntu` is `registry-1.docker.io/library/ubuntu:latest`;
the first component is a registry when it has a `.` or `:` or is `localhost`.

Authentication: a registry answering 401 with `WWW-Authenticate: Bearer realm=...,service=...,scope=...` gets a
token from the realm (anonymous, or with basic credentials from `$C2JAX_REGISTRY_AUTH_<REGISTRY>`, e.g.
`C2JAX_REGISTRY_AUTH_GHCR_IO=user:token`, else `$C2JAX_REGISTRY_AUTH=user:password` for every registry), and
the request is retried with it; a `Basic` challenge gets the credentials directly. The registry's Authorization
is sent to the registry's own host only: blob redirects (to object storage on another host) go without it.
Plain HTTP is used for localhost / 127.0.0.1 / ::1 registries (or `insecure=True`), HTTPS otherwise; proxies
from the environment apply except for loopback hosts.

Failures (unreachable registry, 404, refused credentials, a digest mismatch, no manifest for the platform) raise
`RegistryError`, naming the reference, the URL and the cause.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import shutil
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from c2jax.rl.sandbox.oci import (
    IMAGE_STORE_ENV,
    PLATFORM,
    ImageError,
    find_in_store,
    read_image_config,
    store_name,
)

DOCKER_HUB = "registry-1.docker.io"
_HUB_ALIASES = ("docker.io", "index.docker.io", DOCKER_HUB)
AUTH_ENV = "C2JAX_REGISTRY_AUTH"
REF_NAME = "org.opencontainers.image.ref.name"

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_ACCEPT = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
_INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
_MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
_MAX_MANIFEST = 4 << 20  # bytes; containerd's limit too
_MAX_REDIRECTS = 10
_BLOB_RETRIES = 2  # more tries of a blob after a network error or a 5xx
_USER_AGENT = "c2jax-registry/1"


class RegistryError(ImageError):
    """A pull failed; the message names the reference, the URL and the cause."""


class _Transient(RegistryError):
    """A network error or a server error: a blob download is worth another try."""


class _Cancelled(Exception):
    pass


# ------------------------------------------------------------------------------------------- references
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REMOTE_NAME = re.compile(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?")
_TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
_ANY_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")
_NAME_MAX = 255


@dataclass(frozen=True)
class Reference:
    registry: str  # the API host: registry-1.docker.io for Docker Hub
    repository: str  # library/ubuntu
    tag: str | None  # "latest" when neither a tag nor a digest is given; None for a digest-only reference
    digest: str | None  # sha256:<hex> when pinned

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def version(self) -> str:
        """What the manifest is fetched by: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def parse_reference(reference: str) -> Reference:
    """`reference` by Docker's rules (github.com/distribution/reference, `ParseNormalizedNamed`); ValueError
    naming it when it is not one."""
    def bad(why: str) -> ValueError:
        return ValueError(f"invalid image reference {reference!r}: {why}")

    if not isinstance(reference, str) or not reference:
        raise bad("empty")
    if reference != reference.strip() or any(c.isspace() for c in reference):
        raise bad("contains whitespace")
    if re.fullmatch(r"[0-9a-f]{64}", reference):
        raise bad("a 64-character hexadecimal string is an image ID, not a repository name")
    name, at, digest = reference.partition("@")
    if at:
        if not _ANY_DIGEST.fullmatch(digest):
            raise bad(f"malformed digest {digest!r} (expected sha256:<64 hex digits>)")
        if not _SHA256.fullmatch(digest):
            raise bad(f"unsupported digest {digest!r} (only sha256:<64 lowercase hex digits>)")
    tag = None
    colon, slash = name.rfind(":"), name.rfind("/")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise bad(f"invalid tag {tag!r} (letters, digits, '_', '.', '-'; at most 128, not starting with "
                      "'.' or '-')")
    if not name:
        raise bad("no repository name")
    if len(name) > _NAME_MAX:
        raise bad(f"the repository name is longer than {_NAME_MAX} characters")
    first, slash_, rest = name.partition("/")
    if slash_ and ("." in first or ":" in first or first == "localhost" or first.lower() != first):
        registry, remainder = first, rest
        if not _DOMAIN.fullmatch(registry):
            raise bad(f"invalid registry {registry!r}")
    else:
        registry, remainder = "docker.io", name
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in remainder:
            remainder = "library/" + remainder
    if not remainder:
        raise bad("no repository name after the registry")
    if remainder.lower() != remainder:
        raise bad(f"repository name {remainder!r} must be lowercase")
    if not _REMOTE_NAME.fullmatch(remainder):
        raise bad(f"invalid repository name {remainder!r} (lowercase letters, digits and separators '.', '_', "
                  "'__', '-' between them, components joined by '/')")
    return Reference(registry, remainder, tag if tag or at else "latest", digest or None)


def parse_platform(platform: str | tuple[str, ...]) -> tuple[str, ...]:
    """("linux", "amd64") from "linux/amd64"; a variant may follow ("linux/arm64/v8")."""
    parts = tuple(platform.split("/")) if isinstance(platform, str) else tuple(platform)
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"invalid platform {platform!r}: expected OS/ARCH or OS/ARCH/VARIANT (linux/amd64)")
    return parts


def _platform_text(p: dict | None) -> str:
    p = p or {}
    return "/".join(str(x) for x in (p.get("os"), p.get("architecture"), p.get("variant")) if x)


def platform_matches(p: dict, platform: tuple[str, ...]) -> bool:
    """Whether a descriptor's (or a config's) os / architecture / variant fit `platform`; a variant counts
    only when `platform` names one, and arm64's default variant v8 matches none given."""
    os_, arch, variant = (*platform, None)[:3]
    if p.get("os") != os_ or p.get("architecture") != arch:
        return False
    return variant is None or p.get("variant") == variant or (not p.get("variant") and variant == "v8")


def select_manifest(index: dict, platform: tuple[str, ...], where: str) -> dict:
    """The descriptor of `index` for `platform`, the first that fits. As oci.py's `_pick_manifest` (which
    always wants linux/amd64, so it is not reused), except that an index of one manifest for another platform
    is refused rather than taken: a pull names the platform it wants."""
    manifests = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    if not manifests:
        raise RegistryError(f"{where}: the index lists no manifests")
    for desc in manifests:
        p = desc.get("platform")
        if (p is None and len(manifests) == 1) or (isinstance(p, dict) and platform_matches(p, platform)):
            return desc
    has = sorted({_platform_text(m.get("platform")) or "(no platform)" for m in manifests})
    raise RegistryError(f"{where}: no {'/'.join(platform)} manifest (the index has {', '.join(has)})")


# ------------------------------------------------------------------------------------------- HTTP
def _host(netloc: str) -> str:
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def _is_loopback(netloc: str) -> bool:
    host = _host(netloc).lower()
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _credentials(registry: str) -> tuple[str, str, str] | None:
    """(user, password, the variable holding them) for `registry`: $C2JAX_REGISTRY_AUTH_<REGISTRY> (upper case,
    other characters '_'), else $C2JAX_REGISTRY_AUTH."""
    keys = [registry] + (["docker.io"] if registry == DOCKER_HUB else [])
    names = [f"{AUTH_ENV}_{re.sub(r'[^A-Za-z0-9]', '_', k).upper()}" for k in keys] + [AUTH_ENV]
    for var in names:
        value = os.environ.get(var)
        if value:
            user, colon, password = value.partition(":")
            if not colon or not user:
                raise ValueError(f"${var} must be user:password")
            return user, password, var
    return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects come back as HTTPError: the client follows them itself, dropping Authorization off-host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """("bearer", {"realm": ..., "service": ..., "scope": ...}) from a WWW-Authenticate header."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v if v else bare
              for k, v, bare in re.findall(r'(\w+)\s*=\s*(?:"([^"]*)"|([^,\s]*))', rest)}
    return scheme.lower(), params


def _error_detail(e: urllib.error.HTTPError) -> str:
    """The registry's own words: `{"errors": [{"code", "message"}]}` of the distribution spec, or the text."""
    try:
        body = e.read(16384)
    except Exception:
        return ""
    try:
        errors = json.loads(body).get("errors") or []
        return "; ".join(f"{x.get('code', '')}: {x.get('message', '')}".strip(": ") for x in errors)
    except (ValueError, AttributeError):
        text = body.decode(errors="replace").strip()
        return " ".join(text.split())[:300]


class _Client:
    """One pull's requests to one repository: the authorization obtained on the way, redirects followed."""

    def __init__(self, text: str, ref: Reference, *, scheme: str, timeout_s: float):
        self.text, self.ref, self.timeout_s = text, ref, timeout_s
        self.origin = (scheme, ref.registry.lower())
        self.base = f"{scheme}://{ref.registry}/v2/{ref.repository}"
        self._auth: str | None = None
        self._lock = threading.Lock()
        self._openers = {loop: urllib.request.build_opener(
            _NoRedirect, urllib.request.ProxyHandler({} if loop else None)) for loop in (True, False)}

    def error(self, url: str, cause: str, cls: type[RegistryError] = RegistryError) -> RegistryError:
        return cls(f"cannot pull {self.text}: {url}: {cause}")

    def _open(self, url: str, headers: dict[str, str], *, registry_auth: bool,
              creds_var: str | None = None) -> http.client.HTTPResponse:
        """The 2xx response to GET `url`, redirects followed; with `registry_auth`, the registry's authorization
        (obtained on a 401) on requests to its own host. `creds_var`: the variable whose credentials the
        request carries (for the message when they are refused)."""
        authenticated = False
        redirects = 0
        first = urllib.parse.urlsplit(url)[:2]
        while True:
            parts = urllib.parse.urlsplit(url)
            own = (parts.scheme, parts.netloc.lower()) == self.origin
            sent = self._auth if registry_auth and own else None
            req_headers = {"User-Agent": _USER_AGENT, **headers}
            if parts[:2] != first:  # credentials given for the first host stay with it
                req_headers.pop("Authorization", None)
            if sent:
                req_headers["Authorization"] = sent
            opener = self._openers[_is_loopback(parts.netloc)]
            try:
                return opener.open(urllib.request.Request(url, headers=req_headers), timeout=self.timeout_s)
            except urllib.error.HTTPError as e:
                with e:
                    location = e.headers.get("Location")
                    if e.code in (301, 302, 303, 307, 308) and location:
                        redirects += 1
                        if redirects > _MAX_REDIRECTS:
                            raise self.error(url, f"more than {_MAX_REDIRECTS} redirects") from None
                        url = urllib.parse.urljoin(url, location)
                        continue
                    if e.code == 401 and registry_auth and own and not authenticated:
                        creds_var = self._authenticate(url, e.headers.get("WWW-Authenticate") or "", sent)
                        authenticated = True
                        continue
                    raise self._http_error(url, e, creds_var) from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", None) or e
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    cause = f"no answer within {self.timeout_s:g} s"
                else:
                    cause = f"registry unreachable ({reason})"
                raise self.error(url, cause, _Transient) from None

    def _http_error(self, url: str, e: urllib.error.HTTPError, creds_var: str | None) -> RegistryError:
        detail = _error_detail(e)
        status = f"HTTP {e.code} {e.reason}" + (f" ({detail})" if detail else "")
        if e.code == 404:
            return self.error(url, f"not found: {status}")
        if e.code in (401, 403):
            hint = (f"the credentials of ${creds_var} were refused, or the repository does not exist" if creds_var
                    else f"the repository does not exist or needs credentials (set ${AUTH_ENV}=user:password "
                         f"or ${AUTH_ENV}_<REGISTRY>)")
            return self.error(url, f"access denied: {status}; {hint}")
        if e.code == 429:
            return self.error(url, f"rate limited: {status}", _Transient)
        return self.error(url, status, _Transient if e.code >= 500 else RegistryError)

    def _authenticate(self, url: str, header: str, sent: str | None) -> str | None:
        """Renews the registry's authorization after a 401 with challenge `header`: the variable of the
        credentials used, if any."""
        try:
            creds = _credentials(self.ref.registry)
        except ValueError as e:
            raise self.error(url, str(e)) from None
        var = creds[2] if creds else None
        with self._lock:
            if self._auth != sent:  # another download already renewed it
                return var
            scheme, params = _challenge(header)
            if scheme == "basic":
                if creds is None:
                    raise self.error(url, f"the registry asks for a user and password: set ${AUTH_ENV}=user:password "
                                          f"or ${AUTH_ENV}_<REGISTRY>")
                self._auth = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
                return var
            if scheme != "bearer" or not params.get("realm"):
                raise self.error(url, f"HTTP 401 with an unsupported challenge {header!r}")
            query = {"service": params.get("service")} if params.get("service") else {}
            query["scope"] = params.get("scope") or f"repository:{self.ref.repository}:pull"
            realm = params["realm"]
            token_url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
            headers = {"Accept": "application/json"}
            if creds is not None:
                headers["Authorization"] = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            try:
                with self._open(token_url, headers, registry_auth=False, creds_var=var) as resp:
                    body = resp.read(1 << 20)
            except RegistryError as e:
                raise RegistryError(f"{e} (fetching a token for {url})") from None
            try:
                doc = json.loads(body)
                token = doc.get("token") or doc.get("access_token")
            except (ValueError, AttributeError):
                token = None
            if not token or not isinstance(token, str):
                raise self.error(token_url, "the token service answered without a token")
            self._auth = "Bearer " + token
            return var

    # ------------------------------------------------------------------ the two endpoints
    def manifest(self, version: str, digest: str | None = None, size: int | None = None) -> tuple[str, bytes, str]:
        """(media type, bytes, digest) of the manifest `version` (tag or digest), checked against `digest`."""
        url = f"{self.base}/manifests/{version}"
        with self._open(url, {"Accept": MANIFEST_ACCEPT}, registry_auth=True) as resp:
            try:
                data = resp.read(_MAX_MANIFEST + 1)
            except (OSError, http.client.HTTPException) as e:
                raise self.error(url, f"download interrupted ({e})") from None
            content_type = (resp.headers.get("Content-Type") or "").split(";")[0].strip()
            header_digest = resp.headers.get("Docker-Content-Digest")
        if len(data) > _MAX_MANIFEST:
            raise self.error(url, f"the manifest is larger than {_MAX_MANIFEST >> 20} MiB")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest is not None and actual != digest:
            raise self.error(url, f"the manifest does not match its digest {digest} (got {actual})")
        if size is not None and len(data) != size:
            raise self.error(url, f"the manifest has {len(data)} bytes, its descriptor says {size}")
        if header_digest and header_digest.startswith("sha256:") and header_digest != actual:
            raise self.error(url, f"the manifest does not match the registry's Docker-Content-Digest "
                                  f"{header_digest} (got {actual})")
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise self.error(url, f"the manifest is not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise self.error(url, "the manifest is not a JSON object")
        media_type = doc.get("mediaType") or content_type
        if doc.get("schemaVersion") == 1 or "distribution.manifest.v1" in media_type:
            raise self.error(url, "a Docker schema 1 manifest: not supported (the registry should serve schema 2)")
        if "manifests" in doc and media_type not in _INDEX_TYPES:
            media_type = OCI_INDEX
        elif "manifests" not in doc and media_type not in _MANIFEST_TYPES:
            if "config" not in doc:
                raise self.error(url, f"unsupported manifest media type {media_type!r}")
            media_type = OCI_MANIFEST
        return media_type, data, actual

    def blob(self, desc: dict, out_dir: Path, cancel: threading.Event | None = None,
             log: Callable[[str], None] | None = None) -> Path:
        """Blob `desc` downloaded to `out_dir/<hex>`, checked against its digest and size; network errors and
        server errors are tried again."""
        digest, size = desc.get("digest"), desc.get("size")
        url = f"{self.base}/blobs/{digest}"
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise self.error(url, f"unsupported or malformed blob digest {digest!r} (sha256 expected)")
        if size is not None and (not isinstance(size, int) or size < 0):
            raise self.error(url, f"descriptor of {digest} has an invalid size {size!r}")
        final = out_dir / digest.split(":")[1]
        if final.exists():
            return final
        for attempt in range(_BLOB_RETRIES + 1):
            try:
                self._download(url, digest, size, final, cancel)
                break
            except _Transient:
                if attempt == _BLOB_RETRIES or (cancel is not None and cancel.is_set()):
                    raise
                time.sleep(0.5 * (attempt + 1))
        if log is not None:
            log(f"{digest} {_human(final.stat().st_size)}")
        return final

    def _download(self, url: str, digest: str, size: int | None, final: Path,
                  cancel: threading.Event | None) -> None:
        part = final.with_name(f".{final.name}.{threading.get_ident()}.part")
        h, n = hashlib.sha256(), 0
        try:
            with self._open(url, {}, registry_auth=True) as resp, part.open("wb") as out:
                while True:
                    if cancel is not None and cancel.is_set():
                        raise _Cancelled
                    try:
                        chunk = resp.read(1 << 20)
                    except (OSError, http.client.HTTPException) as e:
                        raise self.error(url, f"download interrupted after {n} bytes ({e})", _Transient) from None
                    if not chunk:
                        break
                    n += len(chunk)
                    if size is not None and n > size:
                        raise self.error(url, f"blob {digest} is larger than its descriptor's {size} bytes")
                    h.update(chunk)
                    out.write(chunk)
            if size is not None and n != size:
                raise self.error(url, f"blob {digest} is truncated: {n} of {size} bytes", _Transient)
            actual = "sha256:" + h.hexdigest()
            if actual != digest:
                raise self.error(url, f"blob does not match its digest {digest} (got {actual}): corrupt or "
                                      "tampered with")
            os.replace(part, final)
        finally:
            part.unlink(missing_ok=True)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ------------------------------------------------------------------------------------------- pulling
def store_dir(store: str | os.PathLike | None) -> Path:
    """`store`, else $C2JAX_IMAGE_STORE; ValueError naming the variable when neither is set."""
    store = store if store is not None and str(store) else os.environ.get(IMAGE_STORE_ENV)
    if not store:
        raise ValueError(f"no image store: pass one (--store DIR) or set ${IMAGE_STORE_ENV}")
    return Path(store)


def pull(reference: str, store: str | os.PathLike | None = None, *, platform: str | tuple[str, ...] = PLATFORM,
         insecure: bool | None = None, timeout_s: float = 60.0, force: bool = False, jobs: int = 4,
         log: Callable[[str], None] | None = None) -> Path:
    """The image `reference` pulled from its registry into `store` (default $C2JAX_IMAGE_STORE) as an OCI
    layout at `store/<store_name(reference)>`: its path. An image already in the store (layout or tar) is kept
    unless `force`. `insecure`: plain HTTP (None: only for loopback registries). `timeout_s` bounds each
    connection and each read; `jobs` layers download at once; `log` gets a line per blob."""
    ref = parse_reference(reference)
    platform = parse_platform(platform)
    store = store_dir(store)
    existing = find_in_store(reference, store)
    if existing is not None and not force:
        return existing
    scheme = "http" if (_is_loopback(ref.registry) if insecure is None else insecure) else "https"
    client = _Client(reference, ref, scheme=scheme, timeout_s=timeout_s)
    store.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=store))
    try:
        blobs = staging / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        media_type, data, digest = client.manifest(ref.version, ref.digest)
        platform_desc = None
        if media_type in _INDEX_TYPES:
            where = f"cannot pull {reference}: {client.base}/manifests/{ref.version}"
            desc = select_manifest(json.loads(data), platform, where)
            if not isinstance(desc.get("digest"), str) or not _SHA256.fullmatch(desc["digest"]):
                raise RegistryError(f"{where}: unsupported or malformed manifest digest {desc.get('digest')!r}")
            platform_desc = desc.get("platform")
            media_type, data, digest = client.manifest(desc["digest"], desc["digest"], desc.get("size"))
            if media_type in _INDEX_TYPES:
                raise RegistryError(f"{where}: the index entry {desc['digest']} is itself an index")
        manifest = json.loads(data)
        murl = f"{client.base}/manifests/{digest}"
        if not isinstance(manifest.get("config"), dict) or not isinstance(manifest.get("layers", []), list):
            raise client.error(murl, "the manifest has no config or no layer list")
        (blobs / digest.split(":")[1]).write_bytes(data)

        config_path = client.blob(manifest["config"], blobs, log=log)
        try:
            config = json.loads(config_path.read_bytes())
        except ValueError as e:
            config = f"not JSON ({e})"
        if not isinstance(config, dict):
            raise client.error(f"{client.base}/blobs/{manifest['config']['digest']}",
                               f"the image config is {config if isinstance(config, str) else 'not a JSON object'}")
        have = {k: config.get(k) for k in ("os", "architecture", "variant") if config.get(k)}
        if have.get("os") and have.get("architecture") and not platform_matches(have, platform):
            raise client.error(murl, f"no {'/'.join(platform)} manifest: the image is for {_platform_text(have)}")
        platform_desc = platform_desc or have or None

        _download_layers(client, manifest.get("layers") or [], blobs, jobs, log)

        desc = {"mediaType": media_type, "digest": digest, "size": len(data)}
        if platform_desc:
            desc["platform"] = platform_desc
        desc["annotations"] = {REF_NAME: reference}
        (staging / "index.json").write_text(json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                                                        "manifests": [desc]}, indent=1))
        (staging / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        return _move_into_place(staging, store / store_name(reference), reference, store)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _download_layers(client: _Client, layers: list, blobs: Path, jobs: int,
                     log: Callable[[str], None] | None) -> None:
    unique = list({d.get("digest") if isinstance(d, dict) else repr(d): d for d in layers}.values())
    for d in unique:
        if not isinstance(d, dict):
            raise client.error(f"{client.base}/manifests/{client.ref.version}", f"malformed layer descriptor {d!r}")
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="c2jax-pull")
    try:
        futures = [pool.submit(client.blob, d, blobs, cancel, log) for d in unique]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:  # the first failure in the manifest's order
            if f in done and f.exception() is not None and not isinstance(f.exception(), _Cancelled):
                raise f.exception()
    finally:
        cancel.set()  # running downloads stop at their next chunk: nothing writes once the staging goes
        pool.shutdown(wait=True, cancel_futures=True)


def _move_into_place(staging: Path, out: Path, reference: str, store: Path) -> Path:
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=".old-", dir=store)) / "image"
        os.rename(out, old)
        try:
            os.rename(staging, out)
        finally:
            shutil.rmtree(old.parent, ignore_errors=True)
        return out
    try:
        os.rename(staging, out)
    except OSError:
        if find_in_store(reference, store) is None:  # not a concurrent pull of the same image that won
            raise
    return out


# ------------------------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class StoredImage:
    reference: str  # the reference it was saved under (its ref.name annotation / RepoTags), else its store name
    digest: str  # the manifest digest `load_image` would use, or "" when unreadable
    path: Path
    error: str = ""


def _named_references(path: Path) -> list[str]:
    """References an OCI layout or a saved archive names itself by (annotations, `docker save` RepoTags)."""
    names: list[str] = []

    def from_index(index: dict) -> None:
        for m in index.get("manifests") or []:
            ann = m.get("annotations") or {}
            names.extend(v for k in ("io.containerd.image.name", REF_NAME) if isinstance(v := ann.get(k), str))

    if path.is_dir():
        from_index(json.loads((path / "index.json").read_text()))
        return names
    with tarfile.open(path) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        if "index.json" in members:
            from_index(json.load(tar.extractfile(members["index.json"])))
        if "manifest.json" in members:
            for entry in json.load(tar.extractfile(members["manifest.json"])) or []:
                names.extend(t for t in entry.get("RepoTags") or [] if isinstance(t, str))
    return names


def stored_images(store: str | os.PathLike | None = None) -> list[StoredImage]:
    """Every image of the store (layout directories and archives), sorted by name."""
    store = store_dir(store)
    if not store.is_dir():
        raise ValueError(f"image store {store}: no such directory")
    out = []
    for path in sorted(store.iterdir()):
        if path.name.startswith("."):
            continue  # staging directories of pulls in progress
        if path.is_dir() and (path / "index.json").is_file():
            name = path.name
        elif path.is_file() and path.name.endswith(".tar"):
            name = path.name[:-len(".tar")]
        else:
            continue
        try:
            digest = read_image_config(path)[0]
            refs = [r for r in _named_references(path) if store_name(r) == name]
            out.append(StoredImage(refs[0] if refs else name, digest, path))
        except (ImageError, OSError, ValueError, KeyError, tarfile.TarError) as e:
            out.append(StoredImage(name, "", path, error=str(e)))
    return out
