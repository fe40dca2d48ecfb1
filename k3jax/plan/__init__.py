"""`k3jax plan`: will a step fit a TPU pod, on which mesh, how fast."""

from k3jax.plan.train import (CHIPS, Chip, Plan, best, candidate_meshes, chip_of, gib,
                              plan_config, plan_one, report, run_plan, topology_devices)

__all__ = ["CHIPS", "Chip", "Plan", "best", "candidate_meshes", "chip_of", "gib", "plan_config",
           "plan_one", "report", "run_plan", "topology_devices"]
