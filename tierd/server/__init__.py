"""The node daemon: catalog (plain logic) and its asyncio/ZeroMQ front."""
