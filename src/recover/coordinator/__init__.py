"""The membership coordinator: heartbeats with leases, epochs, plans, commit and redo decisions.

- `decide.py`: the pure rules `decide(now, state, message)`, with the rules of a step attempt in
  `attempt.py` and those of the member set (epochs, eviction, the quorum) in `membership.py`;
  `state_store.py`: options, state, JSON form, stores; `messages.py`: the rules' inputs and their
  decoding; `decisions.py`: their outputs; `protocol.py`: the frame, the view, the errors;
  `server.py`: the asyncio server (also hosts the torch TCPStore), in layers: `driver.py` (the
  state fed through `decide`, the record, the saving), `connections.py` (sessions, held replies,
  long-polls, relays), `nodes.py` (the node agents' table); `pacing.py`: its lease queue,
  parked waiters and peer-EOF protocol; `views.py`: the view encoded once per version and sent
  relative to the one a peer holds; `relay.py`: a relay that holds 64-128 replicas' sessions and
  leases in front of the server; `service.py`: the loop thread both run on; `client.py`: what a
  replica's training loop uses (torch-free), over `heartbeats.py` (its session: heartbeats, the
  view, the fence), `channel.py` (a connection that follows the leader among standbys; a node
  agent's link) and `outcomes.py` (what its calls end in: outcomes, named errors); `cli.py`:
  `recover coordinator serve|relay|status`.

Importing this package does not import torch (the server imports it only when it starts a store).
"""

from recover.coordinator.cli import run_coordinator_process
from recover.coordinator.client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnreachable,
    DeadlineExceeded,
    Evicted,
    Outcome,
    QuorumLost,
    RequestRefused,
    StepCommitted,
    StepRedo,
    Stopped,
)
from recover.coordinator.options import CoordinatorOptions
from recover.coordinator.protocol import View
from recover.coordinator.relay import RelayServer
from recover.coordinator.server import CoordinatorServer
from recover.coordinator.state_store import InMemoryStateStore, StateStore

__all__ = [
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorOptions",
    "CoordinatorServer",
    "CoordinatorUnreachable",
    "DeadlineExceeded",
    "Evicted",
    "InMemoryStateStore",
    "Outcome",
    "QuorumLost",
    "RelayServer",
    "RequestRefused",
    "StateStore",
    "StepCommitted",
    "StepRedo",
    "Stopped",
    "View",
    "run_coordinator_process",
]
