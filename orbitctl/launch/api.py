"""What `orbitctl train` calls: check the machine, then train in this process or on ranks started here.

    from orbitctl.launch import api
    profile = api.load_train_profile("profiles/tiny-moe-cpu.yaml")
    result = api.train(profile, steps=3)      # starts hardware.gpus_per_node ranks, returns rank 0's result

In a process a launcher already started (torchrun, deepspeed) this runs the trainer on that rank
and launches nothing. Otherwise a profile of one rank trains here, and one of more ranks gets them
started by :mod:`orbitctl.launch.ranks`; the result is the same :class:`~orbitctl.rl.trainer.TrainResult`.
"""

from __future__ import annotations

from orbitctl.errors import UserError
from orbitctl.launch.fit import check_inputs, check_machine
from orbitctl.launch.ranks import launch_local, launch_nodes, multinode_command, under_launcher
from orbitctl.rl.api import EventFn, TrainResult, load_train_profile

__all__ = ["TrainResult", "dry_run", "load_train_profile", "train"]


def dry_run(profile):
    """What :func:`train` would build for each rank, worked out without weights, GPUs or ranks
    (:class:`~orbitctl.launch.dryrun.DryRun`). Refused (UserError, exit 2) as train refuses the profile, and
    when the model or a data file train would read is not on this machine (:func:`~orbitctl.launch.fit.check_inputs`)."""
    from orbitctl.launch.dryrun import dry_run as work_out
    from orbitctl.rl.api import refuse_before_launch

    refuse_before_launch(profile)  # a value train refuses is named before a missing file
    check_inputs(profile)
    return work_out(profile)


def train(profile, *, fresh: bool = False, steps: int | None = None, on_event: EventFn | None = None,
          hostfile: str | None = None, master_addr: str | None = None) -> TrainResult:
    """Run (or resume) the profile's training with the ranks it names; returns what rank 0 reports."""
    from orbitctl.rl import api

    hw = profile.hardware
    if hw.nodes > 1 and not (hostfile and master_addr):
        raise UserError(f"hardware.nodes: {hw.nodes} needs --hostfile and --master-addr",
                        fix="pass --hostfile FILE (one 'host slots=N' line per node) and --master-addr of the first node")
    if hw.nodes == 1 and (hostfile or master_addr):
        raise UserError("--hostfile and --master-addr start ranks on several nodes; this profile has hardware.nodes: 1",
                        fix="drop them, or set hardware.nodes")
    if under_launcher():
        return api.train(profile, fresh=fresh, steps=steps, on_event=on_event)
    fit = check_machine(profile)  # before any data, model or process group
    if hw.nodes == 1:  # the files on this node; a multi-node run's ranks each read their own node's
        check_inputs(profile)
    if profile.world_size == 1:
        return api.train(profile, fresh=fresh, steps=steps, on_event=on_event)
    api.refuse_before_launch(profile)
    options = {"fresh": fresh, "steps": steps}
    if hw.nodes > 1:
        document = launch_nodes(profile, options, multinode_command(profile, hostfile, master_addr))
    else:
        document = launch_local(profile, options, on_event, numa=fit.numa_known)
    return TrainResult(**document)
