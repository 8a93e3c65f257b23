"""A uvicorn server on 127.0.0.1 in a thread, for tests that need a real one.

Its own module (not conftest) so test files in any folder can import it by a unique name
(pytest puts this folder, the top conftest's, on the import path).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from gmlx.server.shutdown import KEEP_ALIVE_S


@dataclass
class LiveServer:
    """A uvicorn server running ``app`` in a thread, on a socket bound before it starts."""

    app: FastAPI
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    @classmethod
    def start(cls, app: FastAPI, timeout: float = 60.0, *, wait_loaded: bool = True) -> LiveServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                               timeout_keep_alive=KEEP_ALIVE_S))  # as `gmlx serve` runs it
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        if wait_loaded:  # the startup models load in the background: wait for them
            while (starting := app.state.starting) is None or not starting.done():
                if time.monotonic() > deadline:
                    raise RuntimeError("the test server's startup models did not load")
                time.sleep(0.02)
        return cls(app, f"http://127.0.0.1:{port}", server, thread)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def serve_config(folder, yaml_text: str, *, models=("demo",), probe=None) -> LiveServer:
    """A live server for ``yaml_text`` (written to ``folder/gmlx.yaml``) serving ``models``;
    ``probe`` scripts the free memory the server sees."""
    from gmlx.compose import build_app
    from gmlx.config import load_settings

    path = folder / "gmlx.yaml"
    path.write_text(yaml_text)
    settings, _ = load_settings(path).with_models(list(models))
    return LiveServer.start(build_app(settings, probe=probe))


def serve_with_template(root, source, model_id: str, template: str):
    """A live server of one model, ``model_id``: the weights of the folder ``source``
    copied to ``root/model_id`` with ``template`` as its chat template. Returns the
    server and the folder."""
    import shutil

    folder = root / model_id
    shutil.copytree(source, folder)
    (folder / "chat_template.jinja").write_text(template)
    live = serve_config(root, f"server: {{warmup: false}}\nmodels:\n  {model_id}: {{source: {folder}}}\n",
                        models=(model_id,))
    return live, folder


GREEN, RED = 10**12, 10  # a memory probe's readings: plenty of room, almost none


class Headroom:
    """A memory probe a test sets: ``value`` is the free bytes the governor reads."""

    def __init__(self) -> None:
        self.value = GREEN

    def __call__(self) -> int:
        return self.value


SHED_FLOOR = 1000  # a governed server's floor: a probe reading RED is below it


def serve_governed(folder, probe: Headroom) -> LiveServer:
    """A live demo server (two decode slots) whose memory governor reads ``probe`` and
    sheds once it reads RED."""
    return serve_config(folder, f"server:\n  decode_batch: 2\n  governor_floor_bytes: {SHED_FLOOR}\n",
                        probe=probe)


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on (for a server started as a process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*args: str, ready: str = "/health?ready=1", timeout: float = 90.0,
                probe_timeout: float = 2.0) -> tuple[subprocess.Popen, str]:
    """``gmlx serve ARGS`` as a process on a free port, returned once ``ready`` answers
    200, with its URL; its stdout and stderr are one text pipe. A process that exits
    first, or never answers, fails the test with what it printed (and is killed)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gmlx.cli.main", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}{ready}", timeout=probe_timeout).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gmlx serve did not come up"
            time.sleep(0.1)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
        raise


def protocol_error(body: dict, path: str, where: object) -> dict:
    """The inner error of an error body in the protocol of the route at ``path``
    (Anthropic's ``{"type": "error", "error": {type, message}}`` under /v1/messages,
    OpenAI's ``{"error": {message, type, param, code}}`` elsewhere), asserting its shape;
    ``where`` is shown when an assertion fails."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", where
        error = body["error"]
    else:
        error = body["error"]
        assert {"message", "type", "param", "code"} <= set(error), where
    assert isinstance(error["type"], str) and isinstance(error["message"], str), where
    return error
