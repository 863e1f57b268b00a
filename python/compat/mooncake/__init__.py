"""Mooncake Transfer Engine's Python API (mooncake.engine.TransferEngine) on ferry's engine.
Installed only when asked (it shadows a real Mooncake): docs/python.md."""
