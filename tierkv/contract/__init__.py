"""The plugin contract: everything a secondary tier and the cache agree on.

A tier (ours under `tiers/`, or a third party's) is written against these modules and
nothing else of tierkv; the cache, the GPU hop and the engine adapters are built on
them. One idea per module:

- `tier`: `SecondaryTierManager` and `TierConfig`, what a plugin implements, and
  re-exports of every other name a tier needs (plugin authors import `tierkv.tier`,
  which re-exports the same names);
- `slab`: `PrimaryView`, the zero-copy view of the primary's slots a tier reads and
  writes;
- `keys`: `OffloadKey` and the prefix-chained block hashes keys are made of;
- `jobs`: `JobMetadata`, `JobResult`, `ReqContext`;
- `tenants`: how a request's tenant is named (`salt_tenant`, the default tenant);
- `events`: `OffloadingEvent`;
- `errors`: the exception classes (`ConfigError`, `TierUnavailable`, `CorruptBlock`);
- `framing`: the frame around a stored block (header, checksum, optional MAC);
- `mac`: the keyed MAC of frames shared by several trust domains;
- `runner`: per-key jobs under a deadline, worker threads, slot guards;
- `units`: sizes and durations as YAML writes them (`8GiB`, `250ms`);
- `redact`: secrets kept out of messages and dumps;
- `private`: the rule for a tier directory others may not write or own.

The contract stays torch-free and imports nothing of the cache (nor numpy): a plugin
that imports it pulls in neither, and a tier can be built and tested without a GPU
stack. import-linter checks it (`pyproject.toml`, `contract-is-light`). This package
imports none of its modules itself, so importing one (`tierkv.contract.keys`) loads
only what that one needs.
"""
