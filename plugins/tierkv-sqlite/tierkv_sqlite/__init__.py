"""tierkv-sqlite: an example third-party tierkv tier that keeps blocks in SQLite.

Installed, it adds the `sqlite` tier type through the `tierkv.tiers` entry point:

    tiers:
      - {type: sqlite, path: /var/cache/tierkv/blocks.db, capacity: 4GiB}
"""

from __future__ import annotations

from tierkv_sqlite.tier import SqliteTier, SqliteTierConfig

__version__ = "0.1.0"

__all__ = ["SqliteTier", "SqliteTierConfig", "__version__"]
