"""The demo's streamed PD request (``demo.servers.streamed_text`` / ``post_stream``): the
text is the joined events up to ``[DONE]``, and a stream that carries an error or is cut
off fails by name instead of reading as a shorter answer. ``post_stream`` runs against a
small HTTP server on loopback that speaks server-sent events."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from collections.abc import Iterator

import pytest

from vllm_flagcx.demo import servers as sv


def _event(text: str | None = None, **extra: object) -> bytes:
    body = {"choices": [{"index": 0, "text": text}]} if text is not None else extra
    return f"data: {json.dumps(body)}\n\n".encode()


def test_the_events_text_is_joined_up_to_done():
    lines = [_event("Par"), b"\n", _event("is"), _event(choices=[]), b": keep-alive\n",
             _event(""), b"data: [DONE]\n", _event("after done")]
    assert sv.streamed_text(lines) == "Paris"


def test_an_error_event_fails_by_name():
    with pytest.raises(sv.DemoError, match=r"the stream carried an error: .*decode died"):
        sv.streamed_text([_event("a"), _event(error={"message": "decode died"})])


def test_a_stream_cut_before_done_fails_not_a_shorter_answer():
    with pytest.raises(sv.DemoError, match="without \\[DONE\\]"):
        sv.streamed_text([_event("a"), _event("b")])


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        if body["prompt"] == "refuse":
            self.send_response(400)
            self.send_header("Content-Length", "17")
            self.end_headers()
            self.wfile.write(b'{"error": "nope"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(_event("first"))
        self.wfile.flush()
        time.sleep(0.3)  # the rest comes later: the first event's time is apart
        self.wfile.write(_event(" rest") + b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    httpd.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_post_stream_asks_for_a_stream_and_times_the_first_event(server):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    started = time.monotonic()
    text, first, total = sv.post_stream(url, {"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert total <= time.monotonic() - started
    assert text == "first rest"
    assert server.seen == [{"prompt": "hi", "max_tokens": 2, "stream": True}]
    assert first < total - 0.2  # the first event, not the end of the stream


def test_post_stream_names_an_http_refusal(server):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    with pytest.raises(sv.DemoError, match=re.escape('answered HTTP 400: {"error": "nope"}')):
        sv.post_stream(url, {"prompt": "refuse"}, timeout=10)
