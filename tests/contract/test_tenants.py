"""How a cache salt becomes a tenant name: a short, stable digest, never the salt."""

from __future__ import annotations

from tierkv.contract.tenants import salt_tenant


def test_salt_tenant_is_a_short_stable_digest() -> None:
    name = salt_tenant("user-1234")
    assert name is not None and name.startswith("salt-") and len(name) == 13
    assert name == salt_tenant(b"user-1234")  # str or bytes alike
    assert "user-1234" not in name
    assert salt_tenant("user-1235") != name
    assert salt_tenant(None) is None and salt_tenant("") is None


def test_the_name_is_the_same_in_every_process_and_release() -> None:
    """Dashboards keep a tenant's series across restarts and upgrades."""
    assert salt_tenant("user-1234") == "salt-0bc5fe16"
