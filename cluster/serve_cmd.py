"""`kvstrata serve`: one in-process engine behind the gRPC front end.

Every flag can also come from an environment variable, KVSTRATA_<FLAG> (for example
KVSTRATA_GRPC_PORT=6000); a flag on the command line wins. SIGTERM or SIGINT drains: health turns
NOT_SERVING at once, new requests get UNAVAILABLE, and requests in flight get `--grace-period`
seconds to finish before they are aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from kvstrata.cluster.argtypes import integer
from kvstrata.worker.model_source import DEFAULT_MODEL

log = logging.getLogger("kvstrata.serve")

DEFAULTS = {
    "model": DEFAULT_MODEL,
    "grpc_host": "127.0.0.1",
    "grpc_port": "50051",
    "dtype": None,
    "num_gpu_blocks": None,
    "max_model_len": None,
    "max_waiting": "256",
    "max_tokens_limit": "4096",
    "grace_period": "30",
}


def _default(name: str) -> str | None:
    return os.environ.get(f"KVSTRATA_{name.upper()}", DEFAULTS[name])


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over gRPC",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_default("model"), help="alias, HF directory or .gguf file [KVSTRATA_MODEL]")
    p.add_argument("--grpc-host", default=_default("grpc_host"), help="gRPC bind address (default 127.0.0.1) "
                   "[KVSTRATA_GRPC_HOST]")
    p.add_argument("--grpc-port", type=integer, default=_default("grpc_port"),
                   help="gRPC port (default 50051; 0 picks a free one) [KVSTRATA_GRPC_PORT]")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=_default("dtype"),
                   help="[KVSTRATA_DTYPE]")
    p.add_argument("--num-gpu-blocks", type=integer, default=_default("num_gpu_blocks"),
                   help="cap the KV pool at this many blocks [KVSTRATA_NUM_GPU_BLOCKS]")
    p.add_argument("--max-model-len", type=integer, default=_default("max_model_len"),
                   help="[KVSTRATA_MAX_MODEL_LEN]")
    p.add_argument("--max-waiting", type=integer, default=_default("max_waiting"),
                   help="requests allowed to wait for admission before RESOURCE_EXHAUSTED (default 256) "
                   "[KVSTRATA_MAX_WAITING]")
    p.add_argument("--max-tokens-limit", type=integer, default=_default("max_tokens_limit"),
                   help="largest max_tokens a request may ask for (default 4096) [KVSTRATA_MAX_TOKENS_LIMIT]")
    p.add_argument("--grace-period", type=integer, default=_default("grace_period"),
                   help="seconds in-flight requests get to finish on SIGTERM (default 30) [KVSTRATA_GRACE_PERIOD]")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kvstrata.worker.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    llm = LLM(args.model, dtype=args.dtype, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len)
    return asyncio.run(_serve(llm, args))


async def _serve(llm, args: argparse.Namespace) -> int:
    from kvstrata.cluster.engine_service import EngineService
    from kvstrata.cluster.grpc_server import build_server, set_serving

    service = EngineService(llm.engine, max_waiting=args.max_waiting, max_tokens_limit=args.max_tokens_limit)
    server, health, port = build_server(service, f"{args.grpc_host}:{args.grpc_port}")
    await server.start()
    await set_serving(health, True)
    # one line a supervisor (or a test) can wait for
    print(f"kvstrata serving {llm.model_id} gRPC on {args.grpc_host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    in_flight = service.drain()
    await set_serving(health, False)
    log.info("draining: %d requests in flight, grace period %ds", in_flight, args.grace_period)
    if not await service.wait_idle(args.grace_period):
        log.warning("grace period over; aborting %d requests", service.num_in_flight)
    await server.stop(grace=1)
    service.shutdown()
    return 0
