"""Deterministic simulation of a relay mesh: network, faults, clients, checkers.

`relay.sim.runner.run_seed` runs one seed; `run_cli` backs `relay sim`.
"""

from relay.sim.faults import FAULT_KINDS, FaultConfig
from relay.sim.runner import SeedResult, run_cli, run_seed

__all__ = ["FAULT_KINDS", "FaultConfig", "SeedResult", "run_cli", "run_seed"]
