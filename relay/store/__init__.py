"""The persistent delta store built from the relays' spools (their format: `relay.segment`).

Modules that need Spark (`ingest`, `snapshot`, `verify`) import it themselves; `changes`,
`chaincheck`, `plan`, `tables` and `reader` need only pyarrow and deltalake, so a relay or a
consumer can use them without a JVM. (The pyarrow baseline of the jobs is a tool:
`relay.tools.store_baseline`.)
"""

# The folder of a store that holds its streams' tables (relay.store.tables): a store exists
# once it is there. Here, so that the relay and the clients can tell without importing
# pyarrow.
STREAMS_DIR = "streams"
