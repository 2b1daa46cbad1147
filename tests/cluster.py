"""How the tests' worker scripts join a JAX cluster of processes on localhost.

The timeouts are sized for a busy 2-core machine (another test suite beside this one): a
process whose heartbeats are late there is slow, not lost. A process that really hangs is
ended by `run_processes`' own limit, which is shorter than these.
"""

import jax

HEARTBEAT_S = 900


def join(port: int, num_processes: int, process_id: int, devices: int) -> None:
  """Joins the cluster on localhost:PORT with `devices` CPU devices per process, gloo
  collectives across processes."""
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"localhost:{port}",
    num_processes=num_processes,
    process_id=process_id,
    heartbeat_timeout_seconds=HEARTBEAT_S,
  )
