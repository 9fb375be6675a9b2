"""`kvstrata client generate`: a small gRPC client that streams a completion to the terminal."""

from __future__ import annotations

import argparse
import os
import sys

from kvstrata.cluster.argtypes import integer, non_negative_float


def add_client_parser(sub) -> None:
    client = sub.add_parser("client", help="talk to a running kvstrata server over gRPC")
    client_sub = client.add_subparsers(dest="client_command", required=True, metavar="COMMAND")
    p = client_sub.add_parser("generate", help="stream one completion to the terminal",
                              description="Stream one completion from a kvstrata server over gRPC.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server (default 127.0.0.1:50051)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=integer, default=64, help="default 64")
    p.add_argument("--temperature", type=non_negative_float, default=None, help="0 = greedy (default: the server's)")
    p.add_argument("--top-p", type=non_negative_float, default=None)
    p.add_argument("--seed", type=integer, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--kv-eviction", default=None,
                   help="a token eviction policy for this request, e.g. 'streaming(sinks=4, window=252)' (lossy)")
    p.add_argument("--api-key", default=None, help="API key (default: $KVSTRATA_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate, for mTLS")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    p.add_argument("--timeout", type=non_negative_float, default=300.0, help="deadline in seconds (default 300)")
    p.add_argument("--usage", action="store_true", help="print token usage to stderr at the end")
    p.set_defaults(func=run_client_generate)


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


def open_channel(target: str, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None):
    import grpc

    from kvstrata.cluster.grpc_server import MAX_MESSAGE_BYTES

    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if tls_ca is None and tls_cert is None:
        return grpc.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "--tls-ca"),
                                         private_key=_read(tls_key, "--tls-key"),
                                         certificate_chain=_read(tls_cert, "--tls-cert"))
    return grpc.secure_channel(target, creds, options=options)


def run_client_generate(args: argparse.Namespace) -> int:
    import grpc

    from kvstrata.protos.v1 import generation_pb2 as pb
    from kvstrata.protos.v1 import generation_pb2_grpc as pb_grpc

    if not args.prompt:
        raise ValueError("prompt is empty")
    sampling = pb.SamplingOptions(max_tokens=args.max_tokens, stop=args.stop or [])
    for name in ("temperature", "top_p", "seed", "kv_eviction"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    if args.chat:
        request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=args.prompt)]),
                                     sampling=sampling)
    else:
        request = pb.GenerateRequest(text=args.prompt, sampling=sampling)
    key = args.api_key or os.environ.get("KVSTRATA_API_KEY")
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with open_channel(args.target, args.tls_ca, args.tls_cert, args.tls_key) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.HasField("usage") and args.usage:
                    u = response.usage
                    print(f"\n[prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), "
                          f"completion {u.completion_tokens} tokens]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nkvstrata client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0
