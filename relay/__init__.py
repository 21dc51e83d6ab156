"""relay: a leaderless relay mesh over ZeroMQ.

Statically configured relays agree on every stream's timeline through quorum-agreed rolling
digests, repair gaps by anti-entropy and fence themselves when they lose their quorum.
`relay.core` is the pure protocol; `relay.sim` runs it deterministically under faults.
"""

# The one place for the version: pyproject.toml reads it (tool.setuptools.dynamic).
__version__ = "0.1.0"

# The hot modules compiled with mypyc, when set-up built them for exactly these sources
# (relay/native.py); before any of them is imported.
from relay import native as _native

_native.install()
