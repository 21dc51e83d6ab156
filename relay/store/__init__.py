"""The persistent delta store built from the relays' spools (their format: `relay.segment`).

Modules that need Spark (`ingest`, `snapshot`, `verify`) import it themselves; `changes`,
`chaincheck`, `plan` and `reader` need only pyarrow, so a relay or a consumer can use them
without a JVM. (The pyarrow baseline of the jobs is a tool: `relay.tools.store_baseline`.)
"""
