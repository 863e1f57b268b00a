"""sglang.srt.utils, as far as mini_lb uses it."""

import ipaddress


def maybe_wrap_ipv6_address(address: str) -> str:
    """An IPv6 address in brackets, anything else as it is (SGLang's helper)."""
    try:
        ipaddress.IPv6Address(address)
        return f"[{address}]"
    except ValueError:
        return address
