"""`kvstrata serve`: one in-process engine behind the gRPC and OpenAI-compatible HTTP front ends.

Each option comes from, in order of precedence: its command-line flag, its KVSTRATA_<NAME>
environment variable (for example KVSTRATA_GRPC_PORT=6000), the YAML file given by --config (keys are
the option names, with '_' or '-'), and its built-in default.

API keys: `tenant:key` entries, one per line in --api-keys-file and/or comma-separated in the
KVSTRATA_API_KEYS environment variable. With none, the server admits everyone as tenant `default`,
from loopback only, and refuses to bind anything else. KVSTRATA_CACHE_SALT_SECRET (or the file in
--cache-salt-secret-file) keys the per-tenant cache salts; servers that should share prefixes must
share it. Without it each process picks a random one.

SIGTERM or SIGINT drains: health turns NOT_SERVING (HTTP /health 503) at once, new requests get
UNAVAILABLE or 503, and requests in flight get --grace-period seconds to finish before they are aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvstrata.cluster.argtypes import integer, non_negative_float, non_negative_int
from kvstrata.worker.kv_dtypes import KV_DTYPE_NAMES
from kvstrata.worker.model_source import DEFAULT_MODEL

log = logging.getLogger("kvstrata.serve")


def _boolean(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _port(text: str) -> int:
    value = integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def _positive(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "tib": 1 << 40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def _size(text: str) -> int:
    """A byte count: 1073741824, 1GiB, 512MiB, 2GB, 1.5g."""
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB or 512MB, got {text!r}")
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB or 512MB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def _text(text: str) -> str:
    return str(text)


def eviction_spec(text: str) -> str:
    """A token eviction policy spec, checked and written out in full: "h2o(8, 8)" -> "h2o(heavy=8, recent=8)"."""
    from kvstrata.worker.token_eviction import parse_eviction

    try:
        return parse_eviction(str(text), "kv_eviction").spec()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


OPTIONS = [
    Option("model", _text, DEFAULT_MODEL, "alias, HF directory or .gguf file"),
    Option("served_model_name", _text, None, "the model name clients use (default: --model)"),
    Option("grpc_host", _text, "127.0.0.1", "gRPC bind address"),
    Option("grpc_port", _port, 50051, "gRPC port; 0 picks a free one"),
    Option("http_host", _text, "127.0.0.1", "HTTP bind address"),
    Option("http_port", _port, 8000, "HTTP port; 0 picks a free one"),
    Option("disable_grpc", _boolean, False, "serve HTTP only"),
    Option("disable_http", _boolean, False, "serve gRPC only"),
    Option("dtype", _text, None, "float32, bfloat16 or float16 (default: the model's)",
           ("float32", "bfloat16", "float16")),
    Option("num_gpu_blocks", _positive, None, "cap the KV pool at this many blocks (per rank with --tp)"),
    Option("tp", _positive, 1, "tensor-parallel ranks: this process and tp - 1 Ray actors"),
    Option("workers", _positive, 1, "worker groups; more than 1 (or --redis, --address) runs a cluster on Ray"),
    Option("routers", _positive, 1, "router actors of a cluster"),
    Option("worker_gpus", non_negative_float, 0.0, "GPUs Ray reserves for each worker actor of a cluster (1 on "
           "GPU nodes; the other tensor-parallel ranks reserve their own)"),
    Option("routing_policy", _text, "prefix_aware", "how routers place requests",
           ("prefix_aware", "round_robin", "least_loaded", "power_of_two")),
    Option("redis", _text, None, "the shared prefix index: redis://[user:password@]host:port/db, or rediss:// for "
           "TLS (default: an in-process index fed by the workers)"),
    Option("redis_prefix", _text, "kvstrata", "key prefix of this deployment in Redis"),
    Option("redis_password", _text, None, "Redis AUTH password (better: KVSTRATA_REDIS_PASSWORD)"),
    Option("redis_tls_ca", _text, None, "CA certificate for a rediss:// Redis"),
    Option("address", _text, None, "a Ray cluster to join, e.g. 10.0.0.1:6379 (default: start a local Ray)"),
    Option("max_model_len", _positive, None, "context limit (default: the model's)"),
    Option("cpu_kv_bytes", _size, None, "a DRAM tier of this size under the KV pool (e.g. 8GiB), per rank"),
    Option("nvme_kv_dir", _text, None, "an NVMe tier of KV block files in this directory (needs --cpu-kv-bytes)"),
    Option("nvme_kv_bytes", _size, None, "the NVMe tier's capacity (e.g. 200GiB), per rank"),
    Option("kv_dtype", _text, "auto", "store the KV cache as fp16, bf16, fp8_e4m3, fp8_e5m2, int8 or int4 "
           "(lossy, see docs/engine.md); auto: the model's dtype", KV_DTYPE_NAMES),
    Option("kv_eviction", eviction_spec, None, "a token eviction policy for every request (lossy): sliding_window(W), "
           "streaming(sinks=S, window=W), h2o(heavy=H, recent=R) or snapkv(window=O, budget=B)"),
    Option("speculative_tokens", non_negative_int, 0, "draft up to this many tokens a step of each request by "
           "n-gram lookup in their own tokens, checked by the model (faster decoding of repetitive text; 0: off)"),
    Option("nvme_admission", _text, "reuse", "what a full NVMe tier takes: reuse (reused, shallow or pinned "
           "blocks) or all", ("reuse", "all")),
    Option("pin_quota_bytes", _size, None, "most KV one tenant may pin with cache_control (default: half the "
           "lowest tier, the limit for all pins together)"),
    Option("max_waiting", _positive, 256, "requests allowed to wait for admission before 429/RESOURCE_EXHAUSTED"),
    Option("max_tokens_limit", _positive, 4096, "largest max_tokens a request may ask for"),
    Option("grace_period", integer, 30, "seconds in-flight requests get to finish on SIGTERM"),
    Option("api_keys_file", _text, None, "file of tenant:key lines"),
    Option("admin_tenants", _text, None, "comma-separated tenants allowed to use the Admin service"),
    Option("cache_salt_secret_file", _text, None, "file holding the secret that keys per-tenant cache salts"),
    Option("tls_cert", _text, None, "PEM server certificate (turns TLS on for gRPC and HTTP)"),
    Option("tls_key", _text, None, "PEM private key of --tls-cert"),
    Option("tls_client_ca", _text, None, "PEM CA; clients must present a certificate it signed (mTLS)"),
    Option("log_level", _text, "info", "debug, info, warning or error", ("debug", "info", "warning", "error")),
]
_BY_NAME = {o.name: o for o in OPTIONS}


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over gRPC and OpenAI-compatible HTTP",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None, help="YAML file of options [KVSTRATA_CONFIG]")
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        default = "" if o.default is None else f" (default {o.default})"
        help_text = f"{o.help}{default} [KVSTRATA_{o.name.upper()}]"
        if o.parse is _boolean:
            p.add_argument(flag, action="store_const", const=True, default=None, help=help_text)
        else:
            p.add_argument(flag, type=o.parse, default=None, choices=o.choices, help=help_text)
    p.set_defaults(func=run_serve)


def resolve_options(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Flag, then KVSTRATA_<NAME>, then the --config file, then the default. ValueError names the source."""
    env = os.environ if environ is None else environ
    config_path = args.config or env.get("KVSTRATA_CONFIG")
    config = load_config(config_path) if config_path else {}
    resolved: dict[str, Any] = {}
    for o in OPTIONS:
        value = getattr(args, o.name, None)
        if value is None and f"KVSTRATA_{o.name.upper()}" in env:
            value = _convert(o, env[f"KVSTRATA_{o.name.upper()}"], f"KVSTRATA_{o.name.upper()}")
        if value is None and o.name in config:
            value = _convert(o, config[o.name], f"{config_path}: {o.name}")
        resolved[o.name] = o.default if value is None else value
    return resolved


def _convert(o: Option, raw: Any, source: str) -> Any:
    if raw is None:
        return None
    try:
        value = o.parse(str(raw).lower() if isinstance(raw, bool) else str(raw))
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    if o.choices and value not in o.choices:
        raise ValueError(f"{source}: expected one of {', '.join(o.choices)}, got {value!r}")
    return value


def load_config(path: str | Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config: {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of option names to values")
    config = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _BY_NAME:
            raise ValueError(f"--config: {path}: unknown option {key!r}")
        config[name] = value
    return config


def _read_secret(path: str | None) -> str | None:
    if path is None:
        return os.environ.get("KVSTRATA_CACHE_SALT_SECRET")
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cache_salt_secret_file: cannot read {path}: {e.strerror}") from None


def build_auth(opts: dict[str, Any]):
    from kvstrata.cluster.tenants import TenantAuth, is_loopback

    auth = TenantAuth.from_sources(opts["api_keys_file"], os.environ.get("KVSTRATA_API_KEYS"),
                                   opts["admin_tenants"], _read_secret(opts["cache_salt_secret_file"]))
    if auth.open:
        for front in ("grpc", "http"):
            host = opts[f"{front}_host"]
            if not opts[f"disable_{front}"] and not is_loopback(_resolve_host(host)):
                raise ValueError(f"{front}_host {host}: with no API keys configured the server may only bind "
                                 "loopback; give --api-keys-file or KVSTRATA_API_KEYS")
    return auth


def _resolve_host(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def _check_tls(opts: dict[str, Any]) -> None:
    if bool(opts["tls_cert"]) != bool(opts["tls_key"]):
        raise ValueError("tls_cert and tls_key go together: give both or neither")
    if opts["tls_client_ca"] and not opts["tls_cert"]:
        raise ValueError("tls_client_ca needs tls_cert and tls_key")
    if opts["disable_grpc"] and opts["disable_http"]:
        raise ValueError("disable_grpc and disable_http: at least one front end must be on")


def _llm_kwargs(opts: dict[str, Any]) -> dict[str, Any]:
    return dict(model=opts["model"], dtype=opts["dtype"], num_gpu_blocks=opts["num_gpu_blocks"],
                max_model_len=opts["max_model_len"], cpu_kv_bytes=opts["cpu_kv_bytes"],
                nvme_kv_dir=opts["nvme_kv_dir"], nvme_kv_bytes=opts["nvme_kv_bytes"],
                pin_quota_bytes=opts["pin_quota_bytes"], nvme_admission=opts["nvme_admission"],
                tensor_parallel_size=opts["tp"], kv_dtype=opts["kv_dtype"],
                kv_eviction=opts["kv_eviction"], speculative_tokens=opts["speculative_tokens"])


def is_cluster(opts: dict[str, Any]) -> bool:
    """More than one worker, a shared Redis index or a Ray cluster to join: the Ray cluster path."""
    return opts["workers"] > 1 or opts["redis"] is not None or opts["address"] is not None


def cluster_spec(opts: dict[str, Any]):
    from kvstrata.cluster.cluster_service import ClusterSpec
    from kvstrata.router.redis_index import RedisSettings

    redis = None
    if opts["redis"] is not None:
        settings = RedisSettings(url=opts["redis"], prefix=opts["redis_prefix"], password=opts["redis_password"],
                                 tls_ca=opts["redis_tls_ca"])  # ValueError naming the field
        redis = {"url": settings.url, "prefix": settings.prefix, "password": settings.password,
                 "tls_ca": settings.tls_ca}
    return ClusterSpec(opts["workers"], _llm_kwargs(opts), num_routers=opts["routers"],
                       routing_policy=opts["routing_policy"], redis=redis, address=opts["address"],
                       max_waiting=opts["max_waiting"], max_tokens_limit=opts["max_tokens_limit"],
                       worker_gpus=opts["worker_gpus"])


def run_serve(args: argparse.Namespace) -> int:
    from kvstrata.worker.llm import LLM

    opts = resolve_options(args)
    _check_tls(opts)
    auth = build_auth(opts)
    logging.basicConfig(level=opts["log_level"].upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if is_cluster(opts):
        return asyncio.run(_serve(None, opts, auth, cluster_spec(opts)))
    llm = LLM(**_llm_kwargs(opts))
    try:
        return asyncio.run(_serve(llm, opts, auth))
    finally:
        llm.close()


def _uvicorn_server(app, opts: dict[str, Any]):
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # kvstrata serve drains on signals itself
            yield

    tls: dict[str, Any] = {}
    if opts["tls_cert"]:
        tls = {"ssl_certfile": opts["tls_cert"], "ssl_keyfile": opts["tls_key"]}
        if opts["tls_client_ca"]:
            tls.update(ssl_ca_certs=opts["tls_client_ca"], ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(app, host=opts["http_host"], port=opts["http_port"], log_level=opts["log_level"],
                            access_log=False, timeout_graceful_shutdown=1, **tls)
    return Server(config)


async def _serve(llm, opts: dict[str, Any], auth, cluster=None) -> int:
    from kvstrata.cluster.cluster_actors import WORKER_NAME
    from kvstrata.cluster.engine_service import EngineService
    from kvstrata.cluster.grpc_server import build_server, server_credentials, set_serving
    from kvstrata.cluster.http_server import OpenAIServer
    from kvstrata.cluster.metrics import ServingMetrics

    name = opts["served_model_name"] or opts["model"]
    metrics = ServingMetrics(name)
    if cluster is not None:
        from kvstrata.cluster.cluster_service import start_cluster

        service = await asyncio.to_thread(start_cluster, cluster, metrics)
        print(f"kvstrata cluster: {cluster.num_workers} worker(s), {cluster.num_routers} router(s), "
              f"{cluster.routing_policy}, index {'in Redis' if cluster.redis else 'in-process'}", flush=True)
    else:
        service = EngineService(llm.engine, max_waiting=opts["max_waiting"], max_tokens_limit=opts["max_tokens_limit"],
                                metrics=metrics, recover=llm.recover, worker_id=WORKER_NAME.format(0))
    grpc_server = health = http = http_task = None
    scheme = "https" if opts["tls_cert"] else "http"
    if not opts["disable_grpc"]:
        creds = None
        if opts["tls_cert"]:
            creds = server_credentials(opts["tls_cert"], opts["tls_key"], opts["tls_client_ca"])
        grpc_server, health, port = build_server(service, f"{opts['grpc_host']}:{opts['grpc_port']}", creds, auth)
        await grpc_server.start()
        await set_serving(health, True)
        # lines a supervisor (or a test) can wait for
        print(f"kvstrata serving {name} gRPC on {opts['grpc_host']}:{port}", flush=True)
    if not opts["disable_http"]:
        api = OpenAIServer(service, [name, service.model_info.model_id], auth=auth, metrics=metrics)
        http = _uvicorn_server(api.app, opts)
        http_task = asyncio.create_task(http.serve())
        while not http.started:
            if http_task.done():
                service.shutdown()
                raise ValueError(f"http_port {opts['http_port']}: the HTTP server did not start (port in use?)")
            await asyncio.sleep(0.02)
        port = http.servers[0].sockets[0].getsockname()[1]
        print(f"kvstrata serving {name} HTTP on {scheme}://{opts['http_host']}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    in_flight = service.drain()
    if health is not None:
        await set_serving(health, False)
    log.info("draining: %d requests in flight, grace period %ds", in_flight, opts["grace_period"])
    if not await service.wait_idle(opts["grace_period"]):
        log.warning("grace period over; aborting %d requests", service.num_in_flight)
    service.shutdown()
    if http is not None:
        http.should_exit = True
        await http_task
    if grpc_server is not None:
        await grpc_server.stop(grace=1)
    return 0
