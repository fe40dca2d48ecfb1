"""Many processes (hosts): start-up, and which rows of a batch each process supplies
(docs/sharding.md#multi-host).

Start-up (`initialize`): `jax.distributed.initialize(coordinator, num_processes, process_id)`
when the three are given (`--coordinator HOST:PORT --num-processes N --process-id I`); with
`--coordinator auto`, or when the environment names several TPU workers (Cloud TPU / GKE:
`TPU_WORKER_HOSTNAMES`, `TPU_PROCESS_ADDRESSES` or `MEGASCALE_COORDINATOR_ADDRESS`), it calls
`jax.distributed.initialize()` without arguments and JAX's cluster detection fills them in.
On CPU, processes exchange collectives through gloo. Afterwards `jax.devices()` lists every
process's devices and meshes span them all. `barrier` holds every process until all reach it
(the train loop calls it after compiling its step, before the first collective).
`together` runs one step of work on every process and tells each how the others' went: a
process that fails posts its error (one line) to the coordination service, so the others stop
at once with it instead of waiting at a barrier for a process that will never come.

`fetch` reads a global array whole on every process (gathering the other processes' shards),
and `from_main` hands process 0's numpy values to every process (RL's rewards).

Data: a global batch [A, b, T] is split by rows over the batch mesh axes (and by positions over
`context`); each process supplies only the rows (and positions) its devices hold
(`process_rows`, `rows_by_process` along either axis) and `global_batch` assembles the jax.Array
from those alone (`jax.make_array_from_callback`: every device's shard is cut from its own
process's rows; nothing is sent between hosts).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax._src import distributed as _jax_distributed  # the coordination client (barriers)
from jax.experimental import multihost_utils

from sharding.mesh import MeshError

TPU_MULTIHOST_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES")
_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d+$")


def _multihost_env() -> bool:
  for name in TPU_MULTIHOST_ENV:
    if len([h for h in os.environ.get(name, "").split(",") if h.strip()]) > 1:
      return True
  return bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Join the multi-process run the arguments or the environment describe; True if one was
  joined (or already is). Validates the arguments in one line (MeshError)."""
  explicit = coordinator not in (None, "auto")
  if explicit or num_processes is not None or process_id is not None:
    if not (explicit and num_processes is not None and process_id is not None):
      raise MeshError("--coordinator HOST:PORT, --num-processes and --process-id go together "
                      "(or --coordinator auto alone)")
    if not _HOST_PORT.match(coordinator):
      raise MeshError(f"--coordinator {coordinator!r} is not HOST:PORT")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise MeshError(f"--process-id {process_id} is not in [0, --num-processes "
                      f"{num_processes})")
  auto = coordinator == "auto" or (not explicit and _multihost_env())
  if not (explicit or auto):
    return False
  if jax.distributed.is_initialized():
    return True
  if _platforms_include_cpu():
    # CPU devices talk through gloo; harmless where accelerators carry the collectives
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _serial_cpu_collectives()
  if explicit:
    jax.distributed.initialize(coordinator, num_processes, process_id)
  else:
    jax.distributed.initialize()
  return True


# XLA:CPU's concurrency-optimised scheduler lets two independent collectives of a step (an
# all-to-all of the experts, a reduce-scatter of gradients) run in either order, and the CPU
# devices of a multi-process run then entered them in different orders and waited on each
# other in gloo for ever (docs/sharding.md#multi-host)
SERIAL_CPU_COLLECTIVES = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _serial_cpu_collectives() -> None:
  """Schedule a multi-process CPU run's collectives in one order on every device: set before
  the CPU backend starts (XLA reads its flags once), unless XLA_FLAGS already says."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {SERIAL_CPU_COLLECTIVES}".strip()


def barrier(name: str, timeout_s: float) -> None:
  """Wait until every process reaches `name` (at most `timeout_s`), through the coordination
  service, not a collective: gloo gives a peer only 30 s (its rendezvous store's default
  timeout) to join a communicator, and the first collective on a set of devices builds one, so a
  process that compiles more slowly than another would kill the run."""
  client = _jax_distributed.global_state.client
  if client is None or jax.process_count() == 1:
    return
  try:
    client.wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - jaxlib raises its runtime error type; one line instead
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise MeshError(f"not every process reached {name!r} within {timeout_s:g} s (a process "
                    f"died or is slower: raise --startup-timeout): {first}") from None


_POLL_S = 0.2
_steps: collections.Counter = collections.Counter()  # name -> calls so far in this process


@contextlib.contextmanager
def together(name: str, timeout_s: float) -> Iterator[None]:
  """Run the body's step on every process, then wait until every process has finished it.
  A body that raises posts its first line under `name` (and re-raises here); the others then
  raise MeshError("process I: <that line>") as soon as they wait, however long the rest take.
  A process killed outright posts nothing: the others wait for it at most `timeout_s`. Every
  process must run the same steps in the same order (`name` is numbered per call, so a
  command may run a step name more than once). A no-op wait in a single-process run."""
  client = _jax_distributed.global_state.client
  count = jax.process_count()
  _steps[name] += 1
  key = f"k3jax/{name}/{_steps[name]}"
  try:
    yield
  except BaseException as e:
    if client is not None and count > 1:
      text = str(e).strip().splitlines()
      why = ("interrupted" if isinstance(e, KeyboardInterrupt) else text[0] if text
             else type(e).__name__)
      with contextlib.suppress(Exception):  # the coordination service may be gone too
        client.key_value_set(f"{key}/{jax.process_index()}", why)
    raise
  if client is None or count == 1:
    return
  client.key_value_set(f"{key}/{jax.process_index()}", "")
  deadline = time.monotonic() + timeout_s
  while True:
    posted = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(key + "/")}
    failed = sorted(p for p, v in posted.items() if v)
    if failed:
      raise MeshError(f"process {failed[0]}: {posted[failed[0]]}")
    if len(posted) == count:
      return
    if time.monotonic() > deadline:
      missing = sorted(set(range(count)) - set(posted))
      raise MeshError(f"process {missing[0]} did not finish {name!r} within {timeout_s:g} s "
                      "(it died, or is slower)")
    time.sleep(_POLL_S)


_decisions: collections.Counter = collections.Counter()  # name -> calls so far
_KEEP_DECISIONS = 16  # keys of older decisions are deleted (every process read them long ago)


def decided_by_main(name: str, decide: Callable[[], bool], timeout_s: float) -> bool:
  """Process 0's `decide()` at this point, the same answer on every process: process 0 posts
  it as a key of the coordination service and the others wait for the key (no collective, no
  device). For decisions that depend on process 0 alone (its clock: a save every M minutes).
  Every process must call it at the same points in the same order (the calls of one `name`
  are numbered); with one process it is `decide()`."""
  client = _jax_distributed.global_state.client
  if client is None or jax.process_count() == 1:
    return bool(decide())
  _decisions[name] += 1
  n = _decisions[name]
  key = f"k3jax/{name}/{n}"
  if jax.process_index() != 0:
    return client.blocking_key_value_get(key, int(timeout_s * 1000)) == "1"
  value = bool(decide())
  client.key_value_set(key, "1" if value else "0")
  if n > _KEEP_DECISIONS:
    with contextlib.suppress(Exception):
      client.key_value_delete(f"k3jax/{name}/{n - _KEEP_DECISIONS}")
  return value


def _platforms_include_cpu() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
  return not platforms or "cpu" in platforms.split(",")


def is_main_process() -> bool:
  """Process 0 writes what exists once per run (metrics, TensorBoard, plots, JSON files)."""
  return jax.process_index() == 0


def fetch(x: jax.Array) -> np.ndarray:
  """The whole value of a jax.Array on every process, also one whose shards span processes
  (where `jax.device_get` refuses: each process gathers the others' shards)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def from_main(tree: Any) -> Any:
  """Process 0's value of `tree` (numpy arrays of the same shapes and dtypes on every process)
  on every process, bit for bit: what process 0 alone computed (RL's rewards). 64-bit values
  travel as pairs of uint32 and booleans as uint8 (without jax_enable_x64 a float64 sent as it
  is would arrive as float32)."""
  if jax.process_count() == 1:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [np.asarray(x) for x in leaves]
  wire = [np.ascontiguousarray(a).reshape(-1).view(np.uint32) if a.dtype.itemsize == 8 else
          a.astype(np.uint8) if a.dtype == bool else a for a in arrays]
  got = [np.asarray(g) for g in multihost_utils.broadcast_one_to_all(wire)]
  out = [(g.astype(np.uint32).view(a.dtype) if a.dtype.itemsize == 8 else
          g.astype(a.dtype)).reshape(a.shape) for g, a in zip(got, arrays)]
  return jax.tree.unflatten(treedef, out)


def rows_by_process(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                    axis: int = 1) -> dict[int, tuple[int, int]]:
  """process index -> the [start, stop) rows (along `axis`) its devices hold. A process's rows
  must be one contiguous range (true of every mesh `make_mesh` builds, where processes own
  contiguous blocks of devices)."""
  spans: dict[int, list[tuple[int, int]]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    sl = index[axis]
    start, stop, _ = sl.indices(shape[axis])
    spans.setdefault(device.process_index, []).append((start, stop))
  out = {}
  for proc, pieces in spans.items():
    start, stop = min(p[0] for p in pieces), max(p[1] for p in pieces)
    covered = np.zeros(stop - start, bool)
    for a, b in pieces:
      covered[a - start:b - start] = True
    if not covered.all():
      raise MeshError(f"process {proc} holds batch rows that are not one contiguous range; "
                      "use a mesh whose batch axes split the processes evenly")
    out[proc] = (start, stop)
  return out


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                 axis: int = 1) -> tuple[int, int]:
  """The [start, stop) rows this process supplies."""
  return rows_by_process(sharding, shape, axis)[jax.process_index()]


def global_batch(batch: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding,
                 rows: tuple[int, int], num_rows: int, axis: int = 1,
                 positions: tuple[int, int] | None = None,
                 num_positions: int | None = None) -> dict[str, Any]:
  """This process's rows [start, stop) of every batch array -> global jax.Arrays with
  `num_rows` rows along `axis`, placed by `sharding`. `positions` [p0, p1) of `num_positions`:
  the arrays hold only those positions (along axis + 1) of their rows, the ones this process's
  devices hold when a `context` axis splits them (`rows_by_process(..., axis + 1)`); None: the
  arrays hold every position."""
  start, stop = rows
  out = {}
  for key, local in batch.items():
    if local.shape[axis] != stop - start:
      raise ValueError(f"{key}: {local.shape[axis]} local rows for the range {rows}")
    p0, p1 = positions or (0, local.shape[axis + 1])
    total = local.shape[axis + 1] if positions is None else num_positions
    if local.shape[axis + 1] != p1 - p0:
      raise ValueError(f"{key}: {local.shape[axis + 1]} local positions for {positions}")
    shape = local.shape[:axis] + (num_rows, total) + local.shape[axis + 2:]

    def cut(index, local=local, p0=p0, p1=p1, total=total):
      a, b, _ = index[axis].indices(num_rows)
      c, d, _ = index[axis + 1].indices(total)
      if a < start or b > stop or c < p0 or d > p1:
        raise ValueError(f"a device of this process needs rows [{a}, {b}), positions "
                         f"[{c}, {d}) outside [{start}, {stop}), [{p0}, {p1})")
      index = (index[:axis] + (slice(a - start, b - start), slice(c - p0, d - p0))
               + index[axis + 2:])
      return local[index]

    out[key] = jax.make_array_from_callback(shape, sharding, cut)
  return out
