"""A real S3 server on this machine for tests and benchmarks: moto's S3 app over HTTP on 127.0.0.1.

moto comes with the ``test`` extra.

The server binds port 0 and reports the port the OS gave it, so parallel runs never race
for a port. It counts object GETs by key so tests can tell how often each file was
downloaded, by any process on the node.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "lorafleet-test", "AWS_SECRET_ACCESS_KEY": "lorafleet-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


class LocalS3Server:
    def __init__(self) -> None:
        self.object_gets: Counter[str] = Counter()   # "bucket/key" -> GET requests served
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None

    def _counting(self, app):
        def wrapped(environ, start_response):
            path = unquote(environ.get("PATH_INFO", ""))
            if environ.get("REQUEST_METHOD") == "GET" and not environ.get("QUERY_STRING") and path.count("/") >= 2:
                with self._lock:
                    self.object_gets[path.lstrip("/")] += 1
            return app(environ, start_response)

        return wrapped

    def start(self) -> "LocalS3Server":
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        class QuietHandler(MotoRequestHandler):
            def log_request(self, *args, **kwargs) -> None:
                pass

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._counting(app), threaded=True, request_handler=QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-s3", daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server as its S3 endpoint, the way the AWS SDKs read it."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def gets(self, bucket: str, key: str) -> int:
        with self._lock:
            return self.object_gets[f"{bucket}/{key}"]

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)
        self._server.server_close()


def s3_client(server: LocalS3Server):
    import boto3

    env = server.env()
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])


def upload_folder(client, folder: Path, bucket: str, prefix: str) -> None:
    """Every file of ``folder`` under ``s3://bucket/prefix/``."""
    for f in sorted(Path(folder).iterdir()):
        if f.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
