"""Real object-store servers on 127.0.0.1 for tests: moto (S3) and the GCS emulator.

Each server runs as a child process on a free port for the whole test
session. This process reaches it through fsspec's config; child processes
(the multi-process fixture's) through the ``FSSPEC_*`` environment variables
fsspec reads at import.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid

import fsspec

from tests.support.multiprocess import free_port

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # no 60 s gRPC probe

_SERVERS = {
    "s3": (["-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"],
           {"endpoint_url": "http://127.0.0.1:{port}", "key": "test", "secret": "test"}),
    # The emulator serves one request at a time from a listen backlog of 5: under load the
    # kernel drops further connection attempts and clients stall in SYN retransmits (1, 3,
    # 7, ... s). A deeper backlog keeps requests queued instead of dropped.
    "gs": (["-c", "import http.server, sys; http.server.HTTPServer.request_queue_size = 1024; "
            "from gcp_storage_emulator.__main__ import main; "
            "main(['start', '--host', '127.0.0.1', '--port', sys.argv[1], '--in-memory'])",
            "{port}"],
           {"endpoint_url": "http://127.0.0.1:{port}", "token": "anon", "project": "test"}),
}


def _wait_for(port: int, process: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"object-store server exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise TimeoutError(f"object-store server on port {port} did not start in {timeout} s")


def storage_options(env: dict[str, str], protocol: str) -> dict[str, str]:
    """The fsspec constructor arguments the server's ``env`` encodes, for explicit passing."""
    prefix = f"FSSPEC_{protocol.upper()}_"
    return {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}


@contextlib.contextmanager
def object_store_server(protocol: str, command: list[str] | None = None):
    """Yields ``(bucket_url, env)`` for a fresh bucket on a server of ``protocol``.

    ``command``: the server's Python arguments instead of the default, ``{port}`` in them
    replaced by the port (a patched server, say).
    """
    port = free_port()
    args, options = _SERVERS[protocol]
    args = command or args
    process = subprocess.Popen(
        [sys.executable, *(a.format(port=port) for a in args)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(port, process)
        options = {k: v.format(port=port) for k, v in options.items()}
        previous = fsspec.config.conf.get(protocol)
        fsspec.config.conf[protocol] = options
        env = {f"FSSPEC_{protocol.upper()}_{k.upper()}": v for k, v in options.items()}
        env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        if protocol == "gs":  # google-cloud-storage clients (Orbax deletes steps with one)
            env.update(STORAGE_EMULATOR_HOST=options["endpoint_url"], GOOGLE_CLOUD_PROJECT="test")
            os.environ.update(STORAGE_EMULATOR_HOST=options["endpoint_url"],
                              GOOGLE_CLOUD_PROJECT="test")
        bucket = f"ost-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem(protocol, skip_instance_cache=True).mkdir(bucket)
        yield f"{protocol}://{bucket}", env
    finally:
        if "previous" in locals():
            if previous is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = previous
        if protocol == "gs":
            for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT"):
                os.environ.pop(name, None)
        process.kill()
        process.wait(timeout=10)
