import os

# Every test process simulates an 8-device mesh on the CPU; must precede importing jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
