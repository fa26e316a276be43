"""`recover simulate`: project effective throughput at 512 to 100,000 GPUs.

A discrete-event simulator of a pre-training job under four fault-tolerance policies (recover,
checkpoint-restart, shrink, spares), with costs from `recover bench` JSON scaled by the rules in
docs/simulator.md. Modules: `model` (pure job, cost and failure models), `engine` (the event
heap), `policies`, `scenarios` (the paper's scenario, the scale and MTBF sweeps, calibration),
`validate` (predicted vs measured run folders), `report` (tables, JSON, plots), `cli`.
"""

from recover.tooling.simulate.engine import SimResult
from recover.tooling.simulate.model import Costs, JobShape, PoissonFailures, StepFailures
from recover.tooling.simulate.policies import simulate

__all__ = ["Costs", "JobShape", "PoissonFailures", "SimResult", "StepFailures", "simulate"]
