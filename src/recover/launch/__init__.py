"""The local launcher: `recover train --replicas R` and `recover run` on one machine.

The launcher itself is recover.launch.local (`LocalLauncher`, `ScriptLauncher`: start, supervise,
respawn, stop, the verdict); it drives a process table and the replicas' restart rule shared with
the node agent (recover.supervisor), the job's coordinators (recover.launch.coordinators) and its
warm standbys (recover.launch.standbys); what it is asked to do is a `LaunchConfig`
(recover.launch.config).
"""

from recover.launch.config import (
    COORDINATOR_FILE,
    FIRED_FILE,
    JOB_FILE,
    TOKEN_FILE,
    LaunchConfig,
    check_gpu_placement,
    visible_gpus,
)
from recover.launch.local import LocalLauncher, ScriptLauncher, train_resume_command

__all__ = [
    "COORDINATOR_FILE",
    "FIRED_FILE",
    "JOB_FILE",
    "TOKEN_FILE",
    "LaunchConfig",
    "LocalLauncher",
    "ScriptLauncher",
    "check_gpu_placement",
    "train_resume_command",
    "visible_gpus",
]
