"""NIXL's Python API on ferry's transfer engine: `from nixl._api import nixl_agent,
nixl_agent_config` works unchanged. Installed only when asked (it shadows a real NIXL): put
build/<preset>/python/compat (or <prefix>/lib/python3.X/ferry-compat) on sys.path.
docs/python.md, "NIXL compatibility"."""

from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401

__all__ = ["nixl_agent", "nixl_agent_config"]
