"""A real kvstrata server on loopback for tests: one EngineService behind the gRPC and HTTP front
ends, on an event loop in a background thread, sharing the session's model."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from kvstrata.protos.v1 import generation_pb2_grpc as pb_grpc


class LiveServer:
    def __init__(self, llm, auth=None, grpc_credentials=None, http: bool = True, tls_files=None,
                 model_names=("smollm2-135m",), service=None, **service_kw):
        """tls_files: (cert, key, client_ca or None) for HTTPS; grpc_credentials for gRPC TLS.
        `service`: serve this one (a ClusterService, say) instead of an EngineService over llm."""
        from kvstrata.cluster.engine_service import EngineService
        from kvstrata.cluster.grpc_server import build_server, set_serving
        from kvstrata.cluster.metrics import ServingMetrics

        self.llm = llm
        self.loop = asyncio.new_event_loop()
        self.metrics = ServingMetrics(model_names[0])
        if service is not None:
            service.metrics = self.metrics
            self.service = service
        else:
            self.service = EngineService(llm.engine, metrics=self.metrics, **service_kw)
        self.http = None
        ready = threading.Event()
        errors: list[BaseException] = []

        async def start():
            self.server, self.health, self.port = build_server(self.service, "127.0.0.1:0", grpc_credentials, auth)
            await set_serving(self.health, True)
            await self.server.start()
            if http:
                self._start_http(auth, model_names, tls_files)
                while not self.http.started:
                    if self._http_task.done():
                        raise RuntimeError("HTTP server did not start")
                    await asyncio.sleep(0.02)
                self.http_port = self.http.servers[0].sockets[0].getsockname()[1]

        def run():
            try:
                self.loop.run_until_complete(start())
            except BaseException as e:  # reported to the constructor
                errors.append(e)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "server did not start"
        if errors:
            raise errors[0]
        if grpc_credentials is None:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
            self.gen = pb_grpc.GenerationStub(self.channel)
            self.admin = pb_grpc.AdminStub(self.channel)
        scheme = "https" if tls_files else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.http_port}" if http else None

    def _start_http(self, auth, model_names, tls_files) -> None:
        import uvicorn

        from kvstrata.cluster.http_server import OpenAIServer

        api = OpenAIServer(self.service, list(model_names), auth=auth, metrics=self.metrics)
        tls = {}
        if tls_files:
            import ssl

            cert, key, ca = tls_files
            tls = {"ssl_certfile": cert, "ssl_keyfile": key}
            if ca:
                tls.update(ssl_ca_certs=ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(api.app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, **tls)
        self.http = uvicorn.Server(config)
        self._http_task = self.loop.create_task(self.http.serve())

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        self.service.shutdown()

        async def stop_all():
            if self.http is not None:
                self.http.should_exit = True
                await asyncio.wait_for(self._http_task, 10)
            await self.server.stop(None)

        self.run(stop_all(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def used_blocks(llm) -> int:
    return llm.engine.kv.pool.num_used_blocks


def wait_for_used_blocks(llm, expected: int, timeout: float = 10.0) -> int:
    """Blocks held by requests, once it returns to `expected` (aborts land on the engine thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if used_blocks(llm) == expected and not llm.engine.has_unfinished_requests():
            break
        time.sleep(0.05)
    return used_blocks(llm)


def wait_for_line(proc, needle: str, timeout: float = 120.0) -> str:
    """The first line of a `kvstrata serve` subprocess's output that contains needle."""
    line = ""
    deadline = time.monotonic() + timeout
    while needle not in line and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "serve exited early"
    return line
