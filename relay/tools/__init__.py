"""Tools that are not part of a running relay: `relay bench` (`bench`), the store jobs'
single-process pyarrow baseline (`store_baseline`) and the synthetic spool generator
(`synthetic`) for the tests and `scripts/bench_store.py`.

They build on the runtime modules (client, launcher, store); no runtime module imports
them.
"""
