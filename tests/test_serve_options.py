"""`kvstrata serve` options: flags, KVSTRATA_* variables and the YAML config, and the checks made
before any model is loaded."""

from __future__ import annotations

import pytest

from kvstrata.cluster.cli import build_parser, main
from kvstrata.cluster.serve_cmd import OPTIONS, build_auth, resolve_options


def _opts(argv: list[str], env: dict[str, str] | None = None) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    return resolve_options(args, env or {})


def test_defaults():
    o = _opts([])
    assert (o["grpc_host"], o["grpc_port"], o["http_host"], o["http_port"]) == ("127.0.0.1", 50051, "127.0.0.1", 8000)
    assert o["max_waiting"] == 256 and o["disable_http"] is False


def test_flag_beats_env_beats_config_beats_default(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("grpc-port: 7001\nhttp_port: 7002\nmax_waiting: 9\ndisable_grpc: true\n")
    o = _opts(["--config", str(cfg), "--grpc-port", "7100"], {"KVSTRATA_HTTP_PORT": "7200"})
    assert o["grpc_port"] == 7100  # flag
    assert o["http_port"] == 7200  # environment
    assert o["max_waiting"] == 9  # config
    assert o["disable_grpc"] is True  # config, a YAML boolean
    assert o["max_tokens_limit"] == 4096  # default
    o = _opts([], {"KVSTRATA_CONFIG": str(cfg)})
    assert o["grpc_port"] == 7001


@pytest.mark.parametrize("content, needle", [
    ("grpc_prot: 1\n", "unknown option 'grpc_prot'"),
    ("- a\n- b\n", "mapping"),
    ("grpc_port: [1\n", "not valid YAML"),
    ("grpc_port: 70000\n", "grpc_port: expected a port"),
    ("dtype: float8\n", "dtype: expected one of"),
    ("disable_http: maybe\n", "disable_http: expected true or false"),
])
def test_bad_config_names_the_option(tmp_path, content, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(content)
    with pytest.raises(ValueError, match=needle):
        _opts(["--config", str(cfg)])


def test_tier_sizes_take_units(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu_kv_bytes: 2GiB\nnvme_kv_dir: /var/kv\n")
    o = _opts(["--config", str(cfg), "--nvme-kv-bytes", "1.5TB"])
    assert (o["cpu_kv_bytes"], o["nvme_kv_dir"], o["nvme_kv_bytes"]) == (2 << 30, "/var/kv", 1_500_000_000_000)
    for bad in ("lots", "0", "-1GiB", "inf", "3XB"):
        with pytest.raises(ValueError, match="KVSTRATA_CPU_KV_BYTES"):
            _opts([], {"KVSTRATA_CPU_KV_BYTES": bad})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="KVSTRATA_MAX_WAITING: expected a positive integer"):
        _opts([], {"KVSTRATA_MAX_WAITING": "0"})


def test_help_documents_every_option_and_its_variable(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for o in OPTIONS:
        assert "--" + o.name.replace("_", "-") in out
        assert f"KVSTRATA_{o.name.upper()}" in out
    assert "--config" in out and "KVSTRATA_API_KEYS" in out


def test_without_keys_only_loopback_binds(monkeypatch, capsys):
    monkeypatch.delenv("KVSTRATA_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="http_host 0.0.0.0: with no API keys"):
        build_auth(_opts(["--http-host", "0.0.0.0"]))
    assert build_auth(_opts(["--http-host", "0.0.0.0", "--disable-http"])).open
    # through the command: a one-line error and exit status 2, before any model is loaded
    assert main(["serve", "--grpc-host", "0.0.0.0"]) == 2
    assert "grpc_host 0.0.0.0" in capsys.readouterr().err
    monkeypatch.setenv("KVSTRATA_API_KEYS", "team:" + "k" * 20)
    assert not build_auth(_opts(["--grpc-host", "0.0.0.0"])).open


@pytest.mark.parametrize("argv, needle", [
    (["--tls-cert", "c.pem"], "tls_cert and tls_key go together"),
    (["--tls-client-ca", "ca.pem"], "tls_client_ca needs tls_cert"),
    (["--disable-grpc", "--disable-http"], "at least one front end"),
])
def test_inconsistent_tls_and_front_end_options(argv, needle, capsys):
    assert main(["serve", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_cluster_flags_choose_the_cluster_path_and_build_its_spec():
    from kvstrata.cluster.serve_cmd import cluster_spec, is_cluster

    assert not is_cluster(_opts([]))
    assert is_cluster(_opts(["--workers", "2"])) and is_cluster(_opts(["--address", "10.0.0.1:6379"]))
    opts = _opts(["--redis", "redis://127.0.0.1:6390/0", "--routers", "2", "--routing-policy", "least_loaded"],
                 {"KVSTRATA_REDIS_PASSWORD": "pw", "KVSTRATA_WORKERS": "3"})
    spec = cluster_spec(opts)
    assert (spec.num_workers, spec.num_routers, spec.routing_policy) == (3, 2, "least_loaded")
    assert spec.redis == {"url": "redis://127.0.0.1:6390/0", "prefix": "kvstrata", "password": "pw", "tls_ca": None}
    assert spec.worker_gpus == 0


def test_each_cluster_worker_gets_an_nvme_directory_of_its_own_and_its_gpus():
    from kvstrata.cluster.cluster_actors import worker_kwargs
    from kvstrata.cluster.serve_cmd import cluster_spec

    spec = cluster_spec(_opts(["--workers", "2", "--cpu-kv-bytes", "1GiB", "--nvme-kv-dir", "/var/kv",
                               "--nvme-kv-bytes", "1GiB", "--worker-gpus", "1"]))
    assert spec.worker_gpus == 1.0
    dirs = {worker_kwargs(spec.llm_kwargs, f"kvstrata-worker-{i}")["nvme_kv_dir"] for i in range(2)}
    assert dirs == {"/var/kv/kvstrata-worker-0", "/var/kv/kvstrata-worker-1"}
    assert spec.llm_kwargs["nvme_kv_dir"] == "/var/kv"  # the shared spec is not changed
    with pytest.raises(SystemExit):
        _opts(["--worker-gpus", "-1"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--redis", "http://127.0.0.1:6379"], "redis url"),
    (["--redis", "redis://x", "--redis-prefix", "a b"], "redis prefix"),
])
def test_bad_cluster_options_name_the_option(argv, needle):
    from kvstrata.cluster.serve_cmd import cluster_spec

    with pytest.raises(ValueError, match=needle):
        cluster_spec(_opts(argv))


def test_an_unknown_routing_policy_is_refused():
    with pytest.raises(SystemExit):
        _opts(["--routing-policy", "random"])
