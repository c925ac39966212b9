"""The Ray layer: a driver that places one host worker (a Ray actor) per host and makes them one JAX
program, restarts it from its latest checkpoint when a host dies, runs replicas, and exports metrics
to the Ray dashboard. It knows nothing about RL: each host worker calls podray.training.train.

  train_on_ray(config, run_dir=None, resume=False, address=None, dashboard=False) -> [summary dict]
"""

from podray.cluster.driver import ClusterError, HostGroup, connect, train_on_ray

__all__ = ["ClusterError", "HostGroup", "connect", "train_on_ray"]
