"""`orbitctl train` on a node: check the machine against the profile, start the ranks, run the trainer on each.

    from orbitctl.launch import api
    result = api.train(profile)      # one process, or hardware.gpus_per_node ranks started here

``fit`` (the machine against the profile, before anything heavy), ``ranks`` (PyTorch's elastic
launcher on one node, DeepSpeed's launcher with a hostfile across nodes; events and the result
come back from rank 0 through files), ``worker`` (what each rank runs), ``api`` (the entry point).
"""
