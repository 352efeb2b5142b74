"""The YAML configuration of a tier chain, validated with pydantic.

    namespace: llama3-8b-bf16-tp1
    layout: {block_bytes: 2MiB, groups: [{kind: full, block_size: 16}]}
    primary: {capacity: 8GiB, eviction: arc}
    tiers:
      - {type: memory, capacity: 1GiB}

Each item of `tiers` is validated by the `Config` of the plugin its `type` names.
`${VAR}` (or `${VAR:-default}`, the default itself may hold `${OTHER}`) in any string
expands from the environment; `$$` writes a literal `$`. Every error names the YAML
path and says the bad value once, all problems at once:
`tiers[1].capacity: '12 parsecs' is not a size (use e.g. 8GiB, 512MiB, 4096)`. A file
must be UTF-8 and may not repeat a key. Sizes are bytes in binary units: a size in
bits (`4Gb`) is an error, a decimal one (`2MB`) an error for `layout.block_bytes` and a
logged warning elsewhere (`sizes`). With `check_machine=True` the sizes are also
checked against this machine, in the same error (`tierkv.config.machine`). Secrets (fields
named like `password`, the password of a URL) never appear in an error, and
`CacheConfig.model_dump()` masks them.

One idea per module: `model` (the `CacheConfig` model, tier names), `loading`
(`parse_config`, `load_config`), `reading` (file text and YAML), `environment`
(`${VAR}`), `messages` (errors by YAML path), `sizes` (units), `checks` (across tiers),
`machine` (sizes against this machine). The modules import each other, never this
package, so importing it cannot run in a circle.
"""

from __future__ import annotations

from tierkv.config.loading import load_config, parse_config
from tierkv.config.messages import format_validation_error
from tierkv.config.model import PRIMARY_NAME, CacheConfig, tier_names
from tierkv.config.reading import StrictLoader, decode_utf8

__all__ = [
    "PRIMARY_NAME",
    "CacheConfig",
    "StrictLoader",
    "decode_utf8",
    "format_validation_error",
    "load_config",
    "parse_config",
    "tier_names",
]
