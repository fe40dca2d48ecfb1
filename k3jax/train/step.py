"""The jitted train and eval steps (docs/training.md#the-train-step) over a functional train state.

TrainState, a plain pytree donated to the step:
  params       nested dict of the model's nnx.Params (fp32 master weights)
  router_bias  nested dict of its RouterBias ([n_moe, E]; set by Quantile Balancing only)
  opt_state    optax state of clip_by_global_norm -> Per-Head Muon / AdamW
  step         int32, optimizer steps done
  rng          uint32 key data, split every step. K3's forward has no stochastic part today;
               the key is carried and checkpointed so that one added later (dropout, noisy
               routing) resumes exactly

One step on a batch [A, b, T] (A micro-batches of b rows):
  1. per micro-batch: forward routed with the current bias b_t, summed token NLL (fp32
     log-softmax) and its gradient; summed over micro-batches (lax.scan), so accumulation
     equals one batch of A*b rows up to float summation order;
  2. gradient / valid tokens -> clip by global norm -> Per-Head Muon (warm-up + cosine);
  3. QK-clip of the MLA query/key weights from this step's max logits. The threshold is an
     argument of the compiled step, not a constant in it: off is +inf, where the clip
     multiplies by exactly 1, so runs with and without it share one compiled program;
  4. Quantile Balancing: b_{t+1} = QB(this step's router scores of every micro-batch, padding
     rows excluded; b_t), applied after the update so it routes the next batch only.
     Per-layer expert load (max/mean, dead fraction) is reported for the choices the batch
     made under b_t ("before") and for the choices b_{t+1} makes on the same scores ("after").

On a mesh (`build(cfg, ex, sc, mesh)`, docs/sharding.md) the same functions are jitted with explicit
shardings and traced under `jax.set_mesh(mesh)`: the state lives where the rules table puts it
(optimizer moments with their parameters), batches [A, b, T] split their rows over
data x fsdp x expert, metrics come back replicated; the model is initialised by a jitted init
whose outputs are already sharded (nothing is built whole on one device). Step 4 then runs
inside a shard_map over the batch mesh axes: each device bins its own rows and the histogram
method's only large reduction is one psum of a layer's [E, bins] counts per MoE layer (the
exact method gathers the rows instead). The scores wait for step 4 with each device's rows
split over the tensor ranks, as the MoE layers compute them (whole, all micro-batches' scores
of K3 would be a large share of a device: docs/plan.md#what-got-it-there), and are gathered one
layer at a time. Without a mesh nothing of this exists and the step is the one-device program it
always was.

The compiled functions are cached per (model config, execution, step config, mesh): repeated
runs in one process (tests, resume) compile once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.expert_parallel import row_split_axes
from k3jax.model.lora import AdaptSpec
from k3jax.model.moe import RouterBias
from k3jax.model.quantile_balancing import (
  THRESHOLD_RULES,
  expert_load_stats,
  quantile_balancing_bias,
)
from k3jax.optim import logical_axes_from_state, per_head_muon, qk_clip
from k3jax.run.params import (  # noqa: F401 - re-exported: the loops and tests use step's names
  WEIGHTS,
  adapt_params,
  combine,
  count_params,
  make_model,
  partition,
  plain,
  split_for_training,
  split_model,
  trainable_mask,
)
from k3jax.run.placement import (
  OnMesh,
  fresh_on_mesh,
  init_params,
)
from k3jax.train.loss import model_nll, token_nll  # noqa: F401 - token_nll re-exported
from sharding.placement import (
  batch_sharding,
  check_model_fits,
  like_params,
  replicated,
  variable_shardings,
)
from sharding.rules import BATCH_MESH_AXES

MLA_PATH = ("mla",)
NO_QK_CLIP = np.float32(np.inf)  # the train step's QK-clip threshold when the clip is off


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything static about the step (hashable: it keys the compile cache)."""
  learning_rate: float = 1e-2        # Muon peak learning rate
  adam_learning_rate: float | None = None  # AdamW peak (default: learning_rate)
  warmup_steps: int = 20
  decay_steps: int = 300             # cosine horizon (total steps of the plan)
  end_lr_ratio: float = 0.1          # final lr = ratio * peak
  weight_decay: float = 0.1
  clip_norm: float | None = 1.0
  qb: bool = True
  qb_method: str = "exact"           # "exact" | "histogram"
  qb_rule: str = "k3"                # QB threshold: "k3" (the K3 report's) | "per_expert"
  qb_bins: int = 1000

  def __post_init__(self):
    if self.qb_rule not in THRESHOLD_RULES:
      raise ValueError(f"qb_rule {self.qb_rule!r} is not one of {THRESHOLD_RULES}")


def lr_schedule(sc: StepConfig, peak: float) -> optax.Schedule:
  warmup = min(sc.warmup_steps, max(sc.decay_steps - 1, 0))
  # linear warm-up from peak / warmup (not 0: the first step already learns)
  return optax.warmup_cosine_decay_schedule(
      init_value=peak / max(warmup, 1), peak_value=peak, warmup_steps=warmup,
      decay_steps=max(sc.decay_steps, warmup + 1), end_value=peak * sc.end_lr_ratio)


def optimizer(sc: StepConfig, logical_axes: Any) -> optax.GradientTransformation:
  adam_lr = lr_schedule(sc, sc.adam_learning_rate or sc.learning_rate)
  muon = per_head_muon(lr_schedule(sc, sc.learning_rate), logical_axes=logical_axes,
                       weight_decay=sc.weight_decay, adam_learning_rate=adam_lr)
  if sc.clip_norm is None:
    return muon
  return optax.chain(optax.clip_by_global_norm(sc.clip_norm), muon)


def optimizer_for(sc: StepConfig, logical_axes: Any, spec: AdaptSpec | None
                  ) -> optax.GradientTransformation:
  """Per-Head Muon + AdamW (optimizer) for full fine-tuning; plain AdamW on LoRA adapters, at
  the AdamW peak learning rate (--adam-lr, else --lr). Why not Muon there: an adapter factor is
  a thin [in, r] / [r, out] matrix whose orthogonalised update sets all r singular values to
  one whatever the gradient's spectrum, and B starts at zero, so the first Muon steps move
  B A by a full-rank-r unit step; the alpha / r scaling LoRA recipes tune assumes Adam, and
  Adam's two moments cost nothing next to the frozen base."""
  if spec is None or not spec.lora:
    return optimizer(sc, logical_axes)
  adam = optax.adamw(lr_schedule(sc, sc.adam_learning_rate or sc.learning_rate),
                     b1=0.9, b2=0.95, weight_decay=sc.weight_decay)
  if sc.clip_norm is None:
    return adam
  return optax.chain(optax.clip_by_global_norm(sc.clip_norm), adam)


@dataclasses.dataclass(frozen=True)
class TokenNLL:
  """What `k3jax train` minimises: the summed next-token NLL of a micro-batch's `loss_mask`
  tokens, divided by the batch's loss tokens in the step.

  An objective is a hashable callable (it keys the compile cache) (model, micro-batch) ->
  (summed loss, the model's ModelOutput, {name: metric of the micro-batch}). With `per_token`
  the step divides the summed loss and its gradient by the batch's `loss_mask` tokens; without
  it the objective's sum over micro-batches is the loss as it stands (its own weights
  normalise it: k3jax/rl). Metrics whose name starts with `max_` are reduced over
  micro-batches by max, the others summed. The ModelOutput feeds QK-clip and Quantile
  Balancing as in plain training."""
  per_token = True  # a class constant, not a field: every TokenNLL is the same objective

  def __call__(self, model, mb):
    out, nll_of = model_nll(model, mb["inputs"], mb["segment_ids"])
    return jnp.sum(nll_of(out, mb["targets"], mb["loss_mask"])), out, {}


def _reduce_metrics(extra: dict) -> dict:
  """Per-micro-batch metrics [A, ...] -> one value each (see TokenNLL)."""
  return {k: (jnp.max(v, axis=0) if k.startswith("max_") else jnp.sum(v, axis=0))
          for k, v in extra.items()}


class Steps(NamedTuple):
  graphdef: Any
  logical_axes: Any
  tx: optax.GradientTransformation
  init_params: Any   # seed -> (params, router_bias), placed (jitted with out_shardings on a mesh)
  init: Any          # (params, router_bias, rng) -> TrainState (jitted)
  train: Any         # (TrainState, batch, qk_clip_threshold) -> (TrainState, metrics)
                     #   (jitted, state donated; threshold = inf: no QK-clip)
  eval: Any          # (params, router_bias, batch) -> (nll_sum, tokens)  (jitted)
  forward: Any       # (params, router_bias, inputs, targets, segment_ids, mask)
                     #   -> (token NLL [b, T], router scores [L, b*T, E], experts [L, b*T, k])
  mesh: jax.sharding.Mesh | None = None
  shardings: Any = None       # TrainState of NamedShardings (None without a mesh)
  batch_sharding: Any = None  # of every [A, b, T] batch array (None without a mesh)
  trainable: Any = None       # same tree as params: True where the optimizer updates the leaf


def state_shardings(tx: optax.GradientTransformation, params_abs: nnx.State,
                    bias_abs: nnx.State, mesh: jax.sharding.Mesh, mask: Any = None) -> dict:
  """TrainState of NamedShardings: parameters and router biases by the rules table, every
  optimizer-state leaf that mirrors a (trainable: `mask`) parameter with that parameter,
  scalars replicated."""
  param_sh = variable_shardings(params_abs, mesh)
  params_sds = plain(nnx.as_pure(params_abs))
  train_sds = params_sds if mask is None else partition(params_sds, mask)[0]
  opt_abs = jax.eval_shape(tx.init, train_sds)
  return {"params": param_sh, "router_bias": variable_shardings(bias_abs, mesh),
          "opt_state": like_params(opt_abs, params_sds, param_sh, mesh),
          "step": replicated(mesh), "rng": replicated(mesh)}


@functools.lru_cache(maxsize=8)
def build(cfg: ModelConfig, ex: Execution, sc: StepConfig,
          mesh: jax.sharding.Mesh | None = None, spec: AdaptSpec | None = None,
          objective: Any = TokenNLL()) -> Steps:
  """The steps of `cfg`'s model run as `ex` says (dtypes, remat, loss chunking, kernels) and
  adapted as `spec` asks, on `mesh` with shardings (raises
  sharding.mesh.MeshError, before any compile, when the mesh cannot split the model). With
  LoRA only the adapters are differentiated and hold optimizer state (AdamW: see
  optimizer_for); the base passes through the step untouched (bit-identical). The train step
  minimises `objective` (TokenNLL: next-token prediction; k3jax/rl brings policy-gradient
  ones); its batch holds the arrays the objective reads, each [A, b, T]."""
  abstract = nnx.eval_shape(lambda: make_model(cfg, ex, 0, spec))
  if mesh is not None:
    check_model_fits(nnx.state(abstract), mesh)
  graphdef, params_abs, bias_abs, _ = nnx.split(abstract, WEIGHTS, RouterBias, ...)
  mask = trainable_mask(params_abs, spec)
  train_abs, _ = partition(plain(params_abs), mask)
  axes = plain(logical_axes_from_state(nnx.State(train_abs)))
  tx = optimizer_for(sc, axes, spec)
  lr_of = lr_schedule(sc, sc.learning_rate)
  k, n_experts = cfg.num_experts_per_token, cfg.num_experts

  def forward(params, bias, inputs, segment_ids):
    """(ModelOutput, per-position NLL function of (out, targets, mask))."""
    return model_nll(nnx.merge(graphdef, nnx.State(params), nnx.State(bias)), inputs,
                     segment_ids)

  def nll(params, bias, inputs, targets, segment_ids, mask):
    out, nll_of = forward(params, bias, inputs, segment_ids)
    return nll_of(out, targets, mask)

  def forward_with_routing(params, bias, inputs, targets, segment_ids, mask):
    out, nll_of = forward(params, bias, inputs, segment_ids)
    return (nll_of(out, targets, mask),
            jnp.stack([r.scores_ne for r in out.routing]),
            jnp.stack([r.experts_nk for r in out.routing]))

  def loss_sum(params, bias, mb):
    total, out, extra = objective(nnx.merge(graphdef, nnx.State(params), nnx.State(bias)), mb)
    routing = out.routing
    aux = {
        "tokens": jnp.sum(mb["loss_mask"].astype(jnp.int32)),
        "scores": jnp.stack([r.scores_ne for r in routing]) if routing else None,
        "experts": jnp.stack([r.experts_nk for r in routing]) if routing else None,
        "max_logits": out.mla_max_logits,
        "dropped": jnp.stack([r.dropped_pairs for r in routing]) if routing else None,
        "extra": extra,
    }
    return total, aux

  def loss_trainable(train_p, frozen_p, bias, mb):
    return loss_sum(combine(train_p, frozen_p), bias, mb)

  grad_fn = jax.value_and_grad(loss_trainable, has_aux=True)

  def train(state, batch, qk_clip_threshold):
    (params, frozen), bias = partition(state["params"], mask), state["router_bias"]
    rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))  # forward is deterministic

    def micro(acc, mb):
      (total, aux), g = grad_fn(params, frozen, bias, mb)
      return jax.tree.map(jnp.add, acc, g), (total, aux)

    if batch["inputs"].shape[0] == 1:  # no accumulation: no loop around the whole model
      (total, aux), grads = grad_fn(params, frozen, bias, jax.tree.map(lambda x: x[0], batch))
      totals, aux = total[None], jax.tree.map(lambda x: None if x is None else x[None], aux)
    else:
      zeros = jax.tree.map(jnp.zeros_like, params)
      grads, (totals, aux) = jax.lax.scan(micro, zeros, batch)  # over the A micro-batches
    tokens = jnp.sum(aux["tokens"])
    loss = jnp.sum(totals)
    if objective.per_token:
      denom = jnp.maximum(tokens, 1).astype(jnp.float32)
      grads = jax.tree.map(lambda g: g / denom, grads)
      loss = loss / denom
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "lr": lr_of(state["step"]), "loss_tokens": tokens,
               **_reduce_metrics(aux["extra"])}

    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    if aux["max_logits"] is not None and not (spec is not None and spec.lora):  # base frozen
      max_logits = jnp.max(aux["max_logits"], axis=0)          # over micro-batches: [n_mla, H]
      metrics["mla_max_logit"] = jnp.max(max_logits, axis=-1)  # [n_mla], before any clip
      params = qk_clip(params, {MLA_PATH: max_logits}, logical_axes=axes,
                       threshold=jnp.asarray(qk_clip_threshold, jnp.float32))

    if aux["dropped"] is not None:  # pairs past a capacity factor, per MoE layer (0: dropless)
      metrics["dropped_pairs"] = jnp.sum(aux["dropped"], axis=0)
    if aux["scores"] is not None:
      bias, load = balance(bias, aux["scores"], aux["experts"], batch["segment_ids"])
      metrics.update(load)
    new_state = {"params": combine(params, frozen), "router_bias": bias, "opt_state": opt_state,
                 "step": state["step"] + 1, "rng": jax.random.key_data(rng)}
    return new_state, metrics

  def balance_rows(b_t, scores, experts, segment_ids, axis_name, score_axes=()):
    """QB of every MoE layer from the rows at hand (all of them, or this device's with
    `axis_name` the mapped batch axes); load before and after. One layer at a time
    (lax.map): all layers at once (vmap) holds several [L, tokens, E] fp32 temporaries (the
    thresholds, the histogram's bin indices, the re-routing; docs/plan.md#what-got-it-there
    for K3 on a pod), where one layer's are 1/L of that. `scores` arrive with this device's rows
    split further over `score_axes` (the tensor ranks: k3jax/model/expert_parallel.py computes and
    keeps them so), so each layer's are gathered whole here, one layer at a time."""
    mask = segment_ids.reshape(-1) != 0  # (micro-batch, row, position) order

    def layer(l):
      # [A, L, n, .] -> this layer's [A*n, .], rows in mask's order
      s_ane = scores[:, l]
      if score_axes:
        s_ane = jax.lax.all_gather(s_ane, score_axes, axis=1, tiled=True, to="invarying")
      s_ne = s_ane.reshape(-1, s_ane.shape[-1])
      e_nk = experts[:, l].reshape(-1, experts.shape[-1])
      stats = lambda e: expert_load_stats(e, n_experts, mask=mask, axis_name=axis_name)
      b = b_t[l]
      if sc.qb:
        b = quantile_balancing_bias(s_ne, b, k, method=sc.qb_method, bins=sc.qb_bins,
                                    mask=mask, axis_name=axis_name, thresholds=sc.qb_rule)
      return b, stats(e_nk), stats(jax.lax.top_k(s_ne + b, k)[1])

    b_next, before, after = jax.lax.map(layer, jnp.arange(b_t.shape[0]))
    load = {"load_max_mean_before": before.max_over_mean, "dead_before": before.dead_fraction,
            "load_max_mean_after": after.max_over_mean, "dead_after": after.dead_fraction}
    return b_next, load

  def balance(bias, scores, experts, segment_ids):
    (path, b_t), = _leaves_with_path(bias)
    if mesh is None:
      b_next, load = balance_rows(b_t, scores, experts, segment_ids, None)
    else:  # each device its own rows; reductions over the batch axes inside
      rows_spec = P(None, None, BATCH_MESH_AXES, None)
      score_axes = row_split_axes(cfg, mesh)
      b_next, load = jax.shard_map(
          functools.partial(balance_rows, axis_name=BATCH_MESH_AXES, score_axes=score_axes),
          mesh=mesh, in_specs=(P(), P(None, None, BATCH_MESH_AXES + score_axes, None),
                               rows_spec, P(None, BATCH_MESH_AXES, None)),
          out_specs=P())(b_t, scores, experts, segment_ids)
    return _set_path(bias, path, b_next.astype(b_t.dtype)), load

  def init(params, bias, rng):
    return {"params": params, "router_bias": bias, "opt_state": tx.init(partition(params, mask)[0]),
            "step": jnp.zeros((), jnp.int32), "rng": rng}

  def evaluate(params, bias, batch):
    wide = jnp.promote_types(ex.jnp_dtype, jnp.float32)  # the NLL's dtype (token_nll)

    def one(acc, mb):
      nll_ = nll(params, bias, mb["inputs"], mb["targets"], mb["segment_ids"], mb["loss_mask"])
      return (acc[0] + jnp.sum(nll_),
              acc[1] + jnp.sum(mb["loss_mask"], dtype=jnp.int32)), None
    (total, tokens), _ = jax.lax.scan(one, (jnp.zeros((), wide), jnp.zeros((), jnp.int32)),
                                      batch)
    return total, tokens

  if mesh is None:
    return Steps(graphdef=graphdef, logical_axes=axes, tx=tx,
                 init_params=lambda seed: init_params(cfg, ex, seed, spec), init=jax.jit(init),
                 train=jax.jit(train, donate_argnums=0), eval=jax.jit(evaluate),
                 forward=jax.jit(forward_with_routing), trainable=mask)

  state_sh = state_shardings(tx, params_abs, bias_abs, mesh, mask)
  batch_sh, rep = batch_sharding(mesh), replicated(mesh)
  param_sh, bias_sh = state_sh["params"], state_sh["router_bias"]

  return Steps(
      graphdef=graphdef, logical_axes=axes, tx=tx,
      init_params=fresh_on_mesh(cfg, ex, spec, mesh),
      init=OnMesh(jax.jit(init, in_shardings=(param_sh, bias_sh, rep),
                          out_shardings=state_sh), mesh),
      train=OnMesh(jax.jit(train, donate_argnums=0, in_shardings=(state_sh, batch_sh, rep),
                           out_shardings=(state_sh, rep)), mesh),
      eval=OnMesh(jax.jit(evaluate, in_shardings=(param_sh, bias_sh, batch_sh),
                          out_shardings=rep), mesh),
      forward=OnMesh(jax.jit(forward_with_routing), mesh),
      mesh=mesh, shardings=state_sh, batch_sharding=batch_sh, trainable=mask)


def _leaves_with_path(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _set_path(tree: dict, path, value) -> dict:
  keys = [p.key for p in path]
  out = dict(tree)
  node = out
  for key in keys[:-1]:
    node[key] = dict(node[key])
    node = node[key]
  node[keys[-1]] = value
  return out


def abstract_state(steps: Steps, params: Any, bias: Any) -> Any:
  """Shapes and dtypes of the TrainState for `params` (for an Orbax restore target); on a mesh
  each leaf carries its NamedSharding, so Orbax restores every array straight into its shards;
  without one, the default device (not the saved sharding: a checkpoint of a multi-process
  mesh then restores on one device)."""
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  shapes = jax.eval_shape(steps.init.jitted if isinstance(steps.init, OnMesh) else steps.init,
                          params, bias, rng)
  if steps.shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        shapes)
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                      shapes, steps.shardings)


def place(tree: Any) -> Any:
  """Commit a state to the default device, as Orbax restores it: a fresh and a resumed state
  then lower to the same program (one compile, one persistent-cache entry)."""
  return jax.device_put(tree, jax.devices()[0])


def new_rng(seed: int) -> jax.Array:
  return jax.random.key_data(jax.random.key(seed))
