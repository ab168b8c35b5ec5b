"""A stand-in for the engine's Python, for the launcher's process tests: started as
``fake_engine.py SHIM serve MODEL --host H --port P ...``, it starts a child (as vLLM starts its
engine core), writes both pids to ``$FAKE_ENGINE_PIDS``, then behaves as ``MODEL`` says:
``healthy`` answers ``GET /health``, ``silent`` accepts connections and never answers, ``exit``
exits with code 3 after printing a line."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import time


def main() -> None:
    argv = sys.argv[1:]
    model = argv[2]
    host = argv[argv.index("--host") + 1]
    port = int(argv[argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ["FAKE_ENGINE_PIDS"], "w") as handle:
        handle.write(f"{os.getpid()} {child.pid}\n")
    print(f"fake engine {model} on {host}:{port}", flush=True)
    if model == "exit":
        print("fake engine: cannot load the model", flush=True)
        sys.exit(3)
    if model == "silent":
        listener = socket.create_server((host, port))
        connections = []
        while True:
            connection, _ = listener.accept()
            connections.append(connection)  # held open, never answered

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, port), Health)
    server.serve_forever()
    time.sleep(3600)


if __name__ == "__main__":
    main()
