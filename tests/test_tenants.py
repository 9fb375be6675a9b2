"""API keys, tenants and cache salts (no server)."""

from __future__ import annotations

import pytest

from kvstrata.cluster.tenants import (
    PermissionDenied,
    TenantAuth,
    Unauthenticated,
    bearer_token,
    grpc_peer_host,
    is_loopback,
    parse_key_entries,
)

KEY_A = "a" * 16 + "-alpha"
KEY_B = "b" * 16 + "-beta"


def test_key_entries_from_lines_and_commas():
    text = f"# keys\nalpha:{KEY_A}\n\n  beta : {KEY_B} "
    assert parse_key_entries(text, "f") == {KEY_A: "alpha", KEY_B: "beta"}
    assert parse_key_entries(f"alpha:{KEY_A},beta:{KEY_B}", "env") == {KEY_A: "alpha", KEY_B: "beta"}


@pytest.mark.parametrize("text, needle", [
    ("alpha", "expected tenant:key"),
    (f"bad name:{KEY_A}", "tenant name"),
    ("alpha:short", "at least 16"),
    (f"alpha:{KEY_A}\nbeta:{KEY_A}", "twice"),
])
def test_bad_key_entries_name_the_entry(text, needle):
    with pytest.raises(ValueError, match=needle) as e:
        parse_key_entries(text, "keys.txt")
    assert "keys.txt, entry" in str(e.value)


def test_keys_map_to_tenants_and_wrong_keys_are_refused():
    auth = TenantAuth({KEY_A: "alpha", KEY_B: "beta"}, admin_tenants={"beta"})
    assert auth.authenticate(KEY_A, "10.0.0.7").name == "alpha"
    assert not auth.authenticate(KEY_A, "10.0.0.7").admin
    assert auth.authenticate(KEY_B, "127.0.0.1").admin
    for key in (None, "", KEY_A[:-1], KEY_A + "x", KEY_B.upper()):
        with pytest.raises(Unauthenticated):
            auth.authenticate(key, "127.0.0.1")  # with keys, loopback needs one too
    with pytest.raises(PermissionDenied, match="alpha"):
        auth.require_admin(auth.authenticate(KEY_A, "::1"))


def test_no_keys_means_default_tenant_on_loopback_only():
    auth = TenantAuth()
    assert auth.open
    for host in ("127.0.0.1", "127.3.4.5", "::1", None, "unix:/tmp/s"):
        t = auth.authenticate(None, host)
        assert (t.name, t.admin) == ("default", True)
    for host in ("10.0.0.1", "192.168.1.2", "2001:db8::1", "example.com"):
        with pytest.raises(Unauthenticated, match="loopback"):
            auth.authenticate("anything", host)


def test_admin_tenants_must_have_keys():
    with pytest.raises(ValueError, match="admin_tenants: gamma"):
        TenantAuth({KEY_A: "alpha"}, admin_tenants={"gamma"})


def test_cache_salts_differ_per_tenant_and_follow_the_secret():
    a = TenantAuth(salt_secret=b"s1")
    b = TenantAuth(salt_secret=b"s1")
    c = TenantAuth(salt_secret=b"s2")
    assert a.cache_salt("alpha") == b.cache_salt("alpha")  # servers sharing a secret share prefixes
    assert a.cache_salt("alpha") != a.cache_salt("beta")
    assert a.cache_salt("alpha") != c.cache_salt("alpha")
    assert "alpha" not in a.cache_salt("alpha")
    # no secret given: a random one per instance
    assert TenantAuth().cache_salt("alpha") != TenantAuth().cache_salt("alpha")


def test_from_sources_merges_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"alpha:{KEY_A}\n")
    auth = TenantAuth.from_sources(f, f"beta:{KEY_B}", "beta", "secret")
    assert auth.tenants == {"alpha", "beta"} and auth.admin_tenants == {"beta"}
    with pytest.raises(ValueError, match="api_keys_file: cannot read"):
        TenantAuth.from_sources(tmp_path / "missing")
    with pytest.raises(ValueError, match="two tenants"):
        TenantAuth.from_sources(f, f"beta:{KEY_A}")


def test_header_and_peer_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    assert grpc_peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert grpc_peer_host("ipv6:[::1]:5000") == "::1"
    assert grpc_peer_host("unix:/tmp/sock") is None
    assert is_loopback("::1") and is_loopback("[::1]") and not is_loopback("0.0.0.0")
