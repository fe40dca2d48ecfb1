"""The serving engine (docs/serving.md): continuous batching over per-request KDA state and a
paged MLA latent cache, with an exact prefix cache.

  engine     `Engine`: add / step / abort / has_work / set_params
  scheduler  which tokens run each step; slots, pages, preemption (host side)
  blocks     the page pool and the prefix cache's hash-chained blocks
  runner     the device side: the cache and the one jitted call per step
  request    `SamplingParams`, `RequestOutput`, `FinishReason`
  config     `EngineConfig`, `check_shards`
"""

from k3jax.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, check_shards
from k3jax.engine.engine import Engine, EngineDead
from k3jax.engine.request import FinishReason, LogprobsMode, RequestOutput, SamplingParams

__all__ = ["DEFAULT_MAX_MODEL_LEN", "Engine", "EngineConfig", "EngineDead", "FinishReason",
           "LogprobsMode", "RequestOutput", "SamplingParams", "check_shards"]
