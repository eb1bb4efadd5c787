"""Opt-in shim: with this folder's parent first on PYTHONPATH,
`import mooncake.store` gives tierkv's Mooncake-compatible store. Nothing
else puts it on the path, so a real Mooncake install is never shadowed."""
