"""Images in requests: a part's bytes, loaded and checked before any model sees them.

An :class:`~gmlx.engine.types.ImagePart` names its image by a ``data:`` URI or an
``http(s)://`` URL. :func:`load_image` turns either into a :class:`LoadedImage` (the
bytes, their type and size, and a digest the prompt cache can key on), or raises an
:class:`InvalidRequestError` naming the part (a 413 past the size cap). Fetching is
bounded by a :class:`FetchPolicy`: a size cap, a deadline, an ``image/*`` content type,
a few redirects each checked again, and no address that would let a client make the
server read itself or its network (loopback, link-local, private) unless allowed.

Nothing here does MLX work; it blocks on the network, so callers on an event loop run
it in a thread.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import io
import ipaddress
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import httpx

from gmlx.engine.errors import InvalidRequestError, PayloadTooLargeError
from gmlx.engine.types import ImagePart, Message

MIB = 1 << 20
MAX_REDIRECTS = 3
VISION_EXTRA = "pip install 'gmlx[vision]'"
_SHOWN_URL = 80  # characters of a URL an error repeats (a data: URI can be megabytes)


@dataclass(frozen=True)
class FetchPolicy:
    """How far the server goes to read an image URL.

    Args:
        remote: fetch ``http(s)://`` URLs at all (off: only ``data:`` URIs).
        allow_private: fetch from loopback, link-local and private addresses too.
        max_bytes: the largest image, fetched or inline.
        timeout_s: the whole fetch, redirects included, must finish within this.
    """

    remote: bool = True
    allow_private: bool = False
    max_bytes: int = 20 * MIB
    timeout_s: float = 10.0


DEFAULT_POLICY = FetchPolicy()


@dataclass(frozen=True)
class LoadedImage:
    """An image read and checked: its bytes, the type Pillow found, its size in pixels
    and the hex sha256 of the bytes (what a prompt cache keys an image by)."""

    data: bytes
    mime_type: str
    width: int
    height: int
    sha256: str


def image_parts(messages: Iterable[Message]) -> list[tuple[str, ImagePart]]:
    """Every image of a conversation with where it is (``messages[1].content[2]``)."""
    return [
        (part.where or f"messages[{i}].content[{j}]", part)
        for i, message in enumerate(messages)
        for j, part in enumerate(message.parts)
        if isinstance(part, ImagePart)
    ]


def load_images(messages: Iterable[Message], policy: FetchPolicy) -> list[tuple[str, LoadedImage]]:
    """Every image of a conversation loaded and checked, in order, with where it is.
    Raises the first part's error (see :func:`load_image`)."""
    return [(where, load_image(part, policy, where=where)) for where, part in image_parts(messages)]


def vision_installed() -> bool:
    """Whether mlx-vlm (the ``vision`` extra) is importable."""
    return importlib.util.find_spec("mlx_vlm") is not None


def load_image(part: ImagePart, policy: FetchPolicy, *, where: str) -> LoadedImage:
    """The image a part names, read and decoded.

    Raises InvalidRequestError (400) naming ``where`` for a URL of another scheme, bad
    base64, a fetch that fails or is refused by ``policy``, a body that is not an image,
    or no Pillow to read it with; PayloadTooLargeError (413) past ``policy.max_bytes``.
    """
    url = part.url.strip()
    scheme = urlsplit(url).scheme.lower() if url else ""
    if scheme == "data":
        data = _from_data_uri(url, policy, where)
    elif scheme in ("http", "https"):
        data = _fetch(url, policy, where)
    elif not url:
        raise InvalidRequestError(f"{where}: the image has no URL.", param=where)
    else:
        raise InvalidRequestError(
            f"{where}: an image must be a base64 data: URI or an http(s):// URL, "
            f"not {_shown(url)}.", param=where,
        )
    mime_type, width, height = _decode(data, where)
    return LoadedImage(data, mime_type, width, height, hashlib.sha256(data).hexdigest())


def text_only(where: str, model: str) -> InvalidRequestError:
    """The refusal of an image to a model that takes none, naming the part (and the
    vision extra, where it is not installed)."""
    message = (f"{where}: model {model!r} is text-only and cannot take an image "
               "(serve a vision model: an mlx-vlm folder, a GGUF with mmproj, or demo-vision).")
    if not vision_installed():
        message += f" Vision models need the vision extra: {VISION_EXTRA}."
    return InvalidRequestError(message, param=where)


# -- data: URIs ---------------------------------------------------------------------


def _from_data_uri(url: str, policy: FetchPolicy, where: str) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise InvalidRequestError(f"{where}: the data: URI has no ',' before its data.", param=where)
    media_type, *params = header.split(";")
    _check_type(media_type, where, "the data: URI")
    if "base64" not in (p.strip().lower() for p in params):
        data = unquote_to_bytes(payload)
    else:
        payload = "".join(payload.split())  # clients may wrap base64 lines
        if len(payload) // 4 * 3 > policy.max_bytes:  # refuse before decoding megabytes
            raise _too_large(where, policy)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidRequestError(f"{where}: the image's base64 data is invalid ({e}).",
                                      param=where) from e
    if len(data) > policy.max_bytes:
        raise _too_large(where, policy)
    return data


# -- http(s):// URLs -----------------------------------------------------------------


def _fetch(url: str, policy: FetchPolicy, where: str) -> bytes:
    """The body of an image URL, redirects followed by hand so each hop is checked."""
    if not policy.remote:
        raise InvalidRequestError(
            f"{where}: this server does not fetch image URLs (server.image_fetch is off); "
            "send the image as a base64 data: URI.", param=where,
        )
    deadline = time.monotonic() + policy.timeout_s
    # trust_env=False: a proxy from the environment would connect where we did not check.
    with httpx.Client(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                hop = _get(client, url, policy, where, deadline)
            except httpx.TimeoutException as e:
                raise InvalidRequestError(
                    f"{where}: fetching {_shown(url)} timed out after {policy.timeout_s:g} s.",
                    param=where) from e
            except httpx.HTTPError as e:
                raise InvalidRequestError(f"{where}: fetching {_shown(url)} failed: {e}.",
                                          param=where) from e
            if isinstance(hop, bytes):
                return hop
            url = hop
    raise InvalidRequestError(
        f"{where}: the image URL redirects more than {MAX_REDIRECTS} times.", param=where
    )


def _get(client: httpx.Client, url: str, policy: FetchPolicy, where: str,
         deadline: float) -> bytes | str:
    """One hop: the body, or the URL it redirects to."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError(f"{where}: cannot fetch the image from {_shown(url)}.", param=where)
    address = _public_address(parts.hostname, parts.port, parts.scheme, policy, where)
    # Connect to the address just checked, not to a second lookup of the name (which
    # a DNS rebinding could point at loopback); the name still goes in Host and SNI.
    host = f"[{address}]" if ":" in address else address
    pinned = parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host).geturl()
    headers = {"Host": parts.netloc.rpartition("@")[2], "Accept": "image/*"}
    with client.stream("GET", pinned, headers=headers,
                       extensions={"sni_hostname": parts.hostname}) as resp:
        if resp.is_redirect:
            location = resp.headers.get("location")
            if not location:
                raise InvalidRequestError(f"{where}: {_shown(url)} redirects nowhere.", param=where)
            return urljoin(url, location)
        if resp.status_code != 200:
            raise InvalidRequestError(
                f"{where}: fetching {_shown(url)} answered HTTP {resp.status_code}.", param=where
            )
        _check_type(resp.headers.get("content-type", "").split(";")[0], where, _shown(url),
                    required=True)
        if int(resp.headers.get("content-length") or 0) > policy.max_bytes:
            raise _too_large(where, policy)
        body = bytearray()
        for chunk in resp.iter_bytes():
            body += chunk
            if len(body) > policy.max_bytes:  # stop reading: the rest is never wanted
                raise _too_large(where, policy)
            if time.monotonic() > deadline:  # httpx's timeout is per read, not in all
                raise httpx.ReadTimeout("deadline passed")
        return bytes(body)


def _public_address(hostname: str, port: int | None, scheme: str, policy: FetchPolicy,
                    where: str) -> str:
    """An address of ``hostname`` to connect to; refuses the name when any of its
    addresses is loopback, link-local, private or otherwise not global (unless the
    policy allows private addresses)."""
    try:
        infos = socket.getaddrinfo(hostname, port or (443 if scheme.lower() == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidRequestError(f"{where}: cannot resolve the image host {hostname!r}.",
                                  param=where) from e
    addresses = [str(info[4][0]).split("%")[0] for info in infos]
    if not policy.allow_private:
        for address in addresses:
            if not _is_public(ipaddress.ip_address(address)):
                raise InvalidRequestError(
                    f"{where}: the image host {hostname!r} is a loopback, link-local or private "
                    f"address ({address}); this server fetches images only from public ones "
                    "(server.image_fetch_private allows the rest).", param=where,
                )
    return addresses[0]


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback too
    return ip.is_global and not ip.is_multicast


# -- shared -----------------------------------------------------------------------------


def _decode(data: bytes, where: str) -> tuple[str, int, int]:
    """The image's type and size; a 400 when Pillow cannot read it (or is missing)."""
    try:
        from PIL import Image
    except ImportError as e:
        raise InvalidRequestError(
            f"{where}: reading images needs Pillow, which the vision extra installs: "
            f"{VISION_EXTRA}.", param=where,
        ) from e
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind, (width, height) = image.format, image.size
            image.verify()  # reads the whole file: a truncated or corrupt one fails here
    except Image.UnidentifiedImageError as e:
        raise InvalidRequestError(f"{where}: the data is not a readable image (not a format "
                                  "Pillow recognises).",
                                  param=where) from e
    except Exception as e:  # Pillow raises many types (and a bomb warning as an error)
        raise InvalidRequestError(f"{where}: the data is not a readable image ({e}).",
                                  param=where) from e
    return Image.MIME.get(kind or "", f"image/{(kind or 'unknown').lower()}"), width, height


def _check_type(media_type: str, where: str, source: str, *, required: bool = False) -> None:
    media_type = media_type.strip().lower()
    if (media_type or required) and not media_type.startswith("image/"):
        raise InvalidRequestError(
            f"{where}: {source} has type {media_type or 'none'!r}, not an image/* type.",
            param=where,
        )


def _too_large(where: str, policy: FetchPolicy) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"{where}: the image is larger than this server's cap of {policy.max_bytes} bytes "
        "(server.image_max_bytes).", param=where,
    )


def _shown(url: str) -> str:
    return url if len(url) <= _SHOWN_URL else url[:_SHOWN_URL] + "..."
