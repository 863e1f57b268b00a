"""A stand-in for the two `sglang` imports of SGLang's mini_lb.py (sglang.srt.disaggregation.utils.
PDRegistryRequest and sglang.srt.utils.maybe_wrap_ipv6_address), so that mini_lb runs unchanged in
front of ferry's workers (scripts/run-sglang-mini-lb). Not part of ferry: never installed."""
