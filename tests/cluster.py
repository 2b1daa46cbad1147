"""The tests' clusters of processes on localhost, both sides: a test starts N processes of a
worker script with `run_processes`; the worker reads its flags with `parser` and joins the
others through `jax.distributed.initialize` with `join`.

The timeouts are sized for a busy 2-core machine (another test suite beside this one): a
process whose heartbeats are late there is slow, not lost. A process that really hangs is
ended by `run_processes`' own limit, which is shorter than these.
"""

import argparse
import os
import pathlib
import socket
import subprocess
import sys

import jax

REPO = pathlib.Path(__file__).resolve().parent.parent
HEARTBEAT_S = 900


def free_port() -> int:
  """A localhost TCP port free now, with the port after it (the trainer's roll call), for a
  server or a cluster's coordinator to bind."""
  while True:
    with socket.socket() as s, socket.socket() as after:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
      try:
        after.bind(("127.0.0.1", port + 1))
      except OSError:
        continue
      return port


def run_processes(script: str, count: int, timeout: float = 300, **flags) -> None:
  """Runs tests/SCRIPT as `count` processes that join over a fresh localhost port (each gets
  --process_id, --num_processes and --port, plus --NAME=VALUE per flag, where a value may
  contain `{i}` for the process id); fails with a process's output if any exits non-zero."""
  port = free_port()
  cluster = [f"--num_processes={count}", f"--port={port}"]
  procs = [
    subprocess.Popen(
      [sys.executable, str(REPO / "tests" / script), f"--process_id={i}", *cluster]
      + [f"--{k}={str(v).format(i=i)}" for k, v in flags.items()],
      cwd=REPO,
      env={**os.environ, "PYTHONPATH": str(REPO)},
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(count)
  ]
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout)
      assert p.returncode == 0, out[-3000:]
  finally:
    for p in procs:
      p.kill()


def parser(description: str) -> argparse.ArgumentParser:
  """A worker's flags: those `run_processes` gives every process, and --out, the file this
  process writes."""
  flags = argparse.ArgumentParser(description=description)
  flags.add_argument("--process_id", type=int, required=True)
  flags.add_argument("--num_processes", type=int, required=True)
  flags.add_argument("--port", type=int, required=True)
  flags.add_argument("--out", required=True, help="the file this process writes")
  return flags


def join(args: argparse.Namespace, devices: int = 1) -> None:
  """Joins the cluster of `parser`'s flags on localhost with `devices` CPU devices per
  process, gloo collectives across processes."""
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"localhost:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    heartbeat_timeout_seconds=HEARTBEAT_S,
  )
