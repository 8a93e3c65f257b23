"""Images in requests, read and checked: data: URIs, and URLs fetched within bounds
from a tiny HTTP server on 127.0.0.1 that each test scripts by path."""

from __future__ import annotations

import base64
import hashlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gmlx.engine.errors import InvalidRequestError, PayloadTooLargeError
from gmlx.engine.media import FetchPolicy, image_parts, load_image, load_images
from gmlx.engine.types import ImagePart, Message, TextPart

WHERE = "messages[1].content[2]"
LOCAL = FetchPolicy(allow_private=True, timeout_s=2.0)


def png(width: int = 3, height: int = 2, color: str = "red") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load(url: str, policy: FetchPolicy = LOCAL):
    return load_image(ImagePart(url), policy, where=WHERE)


# -- data: URIs -----------------------------------------------------------------------


def test_data_uri_loads_with_type_size_and_digest() -> None:
    data = png(5, 4)
    image = load(data_uri(data))
    assert (image.mime_type, image.width, image.height) == ("image/png", 5, 4)
    assert image.data == data and image.sha256 == hashlib.sha256(data).hexdigest()


def test_bad_base64_is_a_400_naming_the_part() -> None:
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content\[2\]: .*base64") as e:
        load("data:image/png;base64,iVBOR*not-base64*")
    assert e.value.status == 400 and e.value.param == WHERE


def test_bytes_that_are_not_an_image_are_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="not a readable image"):
        load(data_uri(b"plain text, not pixels"))


def test_a_truncated_image_is_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="not a readable image"):
        load(data_uri(png(64, 64, "blue")[:60]))


def test_a_data_uri_of_another_type_is_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="text/plain"):
        load(data_uri(png(), "text/plain"))


def test_a_data_uri_over_the_cap_is_a_413() -> None:
    with pytest.raises(PayloadTooLargeError, match="image_max_bytes") as e:
        load(data_uri(png(64, 64)), FetchPolicy(max_bytes=100))
    assert e.value.status == 413 and e.value.anthropic_type == "request_too_large"


def test_other_schemes_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="data: URI or an http"):
        load("file:///etc/passwd")


def test_parts_are_named_by_message_and_part_index() -> None:
    messages = [
        Message("system", (TextPart("be brief"),)),
        Message("user", (TextPart("look"), TextPart("here"), ImagePart(data_uri(png())))),
    ]
    assert [w for w, _ in image_parts(messages)] == [WHERE]
    assert [w for w, _ in load_images(messages, LOCAL)] == [WHERE]


# -- URLs -----------------------------------------------------------------------------

Route = Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture
def site() -> Iterator[tuple[str, dict[str, Route]]]:
    """A local HTTP server; tests put a handler per path into the dict."""
    routes: dict[str, Route] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self.send_error(404)
                return
            try:
                route(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading, as it should past the cap

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", routes
    server.shutdown()
    server.server_close()


def serve(body: bytes, content_type: str = "image/png") -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return route


def redirect(to: str) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", to)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return route


def test_loopback_is_refused_by_default(site) -> None:
    url, routes = site
    routes["/cat.png"] = serve(png())
    with pytest.raises(InvalidRequestError, match="loopback, link-local or private"):
        load(f"{url}/cat.png", FetchPolicy())


@pytest.mark.parametrize("host", ["localhost", "[::1]", "10.0.0.1", "169.254.169.254", "0.0.0.0",
                                  "[::ffff:127.0.0.1]"])
def test_private_and_link_local_hosts_are_refused(host: str) -> None:
    with pytest.raises(InvalidRequestError, match="private"):
        load(f"http://{host}:9/x.png", FetchPolicy(timeout_s=0.5))


def test_allow_private_fetches(site) -> None:
    url, routes = site
    data = png(7, 3)
    routes["/cat.png"] = serve(data)
    image = load(f"{url}/cat.png")
    assert (image.width, image.height, image.data) == (7, 3, data)


def test_a_wrong_content_type_is_a_400(site) -> None:
    url, routes = site
    routes["/page"] = serve(b"<html></html>", "text/html")
    with pytest.raises(InvalidRequestError, match="text/html"):
        load(f"{url}/page")


def test_an_http_error_is_a_400(site) -> None:
    url, _ = site
    with pytest.raises(InvalidRequestError, match="HTTP 404"):
        load(f"{url}/missing.png")


def test_an_endless_body_stops_at_the_cap_with_a_413(site) -> None:
    url, routes = site
    sent = []

    def endless(h: BaseHTTPRequestHandler) -> None:  # no Content-Length: only streaming tells
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.end_headers()
        for _ in range(100_000):  # 6 GiB if nobody stopped reading
            h.wfile.write(b"\0" * 65536)
            sent.append(1)

    routes["/big.png"] = endless
    start = time.monotonic()
    with pytest.raises(PayloadTooLargeError):
        load(f"{url}/big.png", FetchPolicy(allow_private=True, max_bytes=200_000))
    assert time.monotonic() - start < 2.0


def test_a_declared_length_over_the_cap_is_a_413_before_reading(site) -> None:
    url, routes = site
    routes["/big.png"] = serve(png(64, 64))
    with pytest.raises(PayloadTooLargeError):
        load(f"{url}/big.png", FetchPolicy(allow_private=True, max_bytes=50))


def test_three_redirects_are_followed_and_a_fourth_is_refused(site) -> None:
    url, routes = site
    routes["/img.png"] = serve(png())
    for i in range(4):
        routes[f"/r{i}"] = redirect(f"/r{i + 1}" if i < 3 else "/img.png")
    assert load(f"{url}/r1").width == 3  # r1 -> r2 -> r3 -> img: three redirects
    with pytest.raises(InvalidRequestError, match="redirects more than 3 times"):
        load(f"{url}/r0")


def test_a_redirect_to_loopback_is_refused(site, monkeypatch) -> None:
    """Every hop is checked: 127.0.0.1 stands in for a public host here, and its
    redirect to 127.0.0.2 (the server's own loopback) is refused before any request."""
    from gmlx.engine import media

    url, routes = site
    port = url.rsplit(":", 1)[1]
    asked: list[str] = []

    def to_own_admin(h: BaseHTTPRequestHandler) -> None:
        asked.append(h.path)
        redirect(f"http://127.0.0.2:{port}/admin")(h)

    routes["/cat.png"] = to_own_admin
    monkeypatch.setattr(media, "_is_public", lambda ip: str(ip) == "127.0.0.1")
    with pytest.raises(InvalidRequestError, match=r"loopback.*\(127\.0\.0\.2\)"):
        load(f"{url}/cat.png", FetchPolicy())
    assert asked == ["/cat.png"]


def test_a_slow_server_times_out_with_a_400(site) -> None:
    url, routes = site

    def slow(h: BaseHTTPRequestHandler) -> None:
        time.sleep(1.5)
        serve(png())(h)

    routes["/slow.png"] = slow
    with pytest.raises(InvalidRequestError, match="timed out"):
        load(f"{url}/slow.png", FetchPolicy(allow_private=True, timeout_s=0.3))


def test_a_dripping_body_is_bounded_by_the_whole_deadline(site) -> None:
    url, routes = site

    def drip(h: BaseHTTPRequestHandler) -> None:  # each read is quick; the whole is not
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.end_headers()
        for _ in range(40):
            h.wfile.write(b"\0")
            h.wfile.flush()
            time.sleep(0.1)

    routes["/drip.png"] = drip
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="timed out"):
        load(f"{url}/drip.png", FetchPolicy(allow_private=True, timeout_s=0.5))
    assert time.monotonic() - start < 1.5


def test_remote_off_refuses_any_url(site) -> None:
    url, routes = site
    routes["/cat.png"] = serve(png())
    with pytest.raises(InvalidRequestError, match="image_fetch is off"):
        load(f"{url}/cat.png", FetchPolicy(remote=False, allow_private=True))


def test_server_settings_become_the_engines_fetch_policy(monkeypatch) -> None:
    from gmlx.compose import build_engine, build_registry
    from gmlx.config import load_settings

    monkeypatch.setenv("GMLX_IMAGE_FETCH", "0")
    monkeypatch.setenv("GMLX_IMAGE_FETCH_PRIVATE", "1")
    monkeypatch.setenv("GMLX_IMAGE_MAX_BYTES", "1000")
    monkeypatch.setenv("GMLX_IMAGE_FETCH_TIMEOUT_S", "2.5")
    settings, _ = load_settings().with_models(["demo"])
    engine = build_engine(settings, build_registry(settings))
    assert engine.fetch_policy == FetchPolicy(remote=False, allow_private=True, max_bytes=1000,
                                              timeout_s=2.5)
