"""LaunchedServer (bench/launch.py) in the caller's session: it starts, answers, and stops
without signalling the caller's process group (which it shares)."""

from __future__ import annotations

import os
import sys

from tandem.bench.launch import LaunchedServer

# A server that answers 200 to every GET, on the port given.
HEALTHY = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def test_a_server_in_the_callers_session_stops_alone(tmp_path):
    server = LaunchedServer(
        [sys.executable, "-c", HEALTHY, "{port}"], tmp_path / "log", 30, new_session=False
    )
    with server:
        assert server.process is not None
        assert os.getsid(server.process.pid) == os.getsid(0)
        assert os.getpgid(server.process.pid) == os.getpgid(0)
    assert server.process.poll() is not None  # it stopped; this process, in its group, did not
