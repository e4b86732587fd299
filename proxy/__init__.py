"""The shardcache caching proxy daemon (aiohttp)."""
