"""The recipe knobs: --schedule cosine | wsd | constant (against closed forms of each shape),
--decay-frac, and --z-loss W (the chunked logsumexp and its gradient against autodiff of the
plain formula, float64; in the train step: loss = NLL + z_loss, z_loss = W mean lse^2 from an
independent forward); bad values refused in one line."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.cli import build_parser
from k3jax.commands import train as train_command
from k3jax.errors import UserError
from k3jax.execution import Execution
from k3jax.train import step as step_lib
from k3jax.train.loop import step_config
from k3jax.train.loss import chunked_token_nll_lse, token_nll_lse

from .helpers import MICRO, options
from .test_step import rows_batch

PEAK, END, WARM, HORIZON = 0.02, 0.1, 4, 50


def closed_form(schedule: str, t: int, decay_frac: float = 0.2) -> float:
  """The learning rate at optimizer step t, written out from the shapes' definitions."""
  if t < WARM:  # linear from PEAK / WARM to PEAK
    return PEAK / WARM + (PEAK - PEAK / WARM) * t / WARM
  if schedule == "constant":
    return PEAK
  if schedule == "cosine":
    start, length = WARM, HORIZON - WARM
  else:  # wsd: flat at the peak, then the last decay_frac of the horizon decays
    start = HORIZON - round(decay_frac * HORIZON)
    length = HORIZON - start
    if t < start:
      return PEAK
  done = min(t - start, length) / length
  return PEAK * (END + (1 - END) * 0.5 * (1 + math.cos(math.pi * done)))


@pytest.mark.parametrize("schedule,decay_frac", [("cosine", 0.2), ("wsd", 0.2), ("wsd", 0.5),
                                                 ("constant", 0.2)])
def test_schedules_follow_their_shape(schedule, decay_frac):
  sc = step_lib.StepConfig(learning_rate=PEAK, warmup_steps=WARM, decay_steps=HORIZON,
                           end_lr_ratio=END, schedule=schedule, decay_frac=decay_frac)
  lr = step_lib.lr_schedule(sc, PEAK)
  for t in range(HORIZON + 10):
    assert float(lr(t)) == pytest.approx(closed_form(schedule, t, decay_frac), rel=1e-6), t
  if schedule == "wsd":  # the stable stage: the peak itself up to the decay
    stable = range(WARM, HORIZON - round(decay_frac * HORIZON) + 1)
    assert all(float(lr(t)) == pytest.approx(PEAK, rel=1e-7) for t in stable)


def test_schedule_flags_reach_the_step():
  base = ["train", "--out", "x", "--schedule", "wsd", "--decay-frac", "0.3", "--z-loss", "1e-4"]
  opts = train_command.options_from_args(build_parser().parse_args(base))
  sc = step_config(opts)
  assert (sc.schedule, sc.decay_frac, opts.z_loss) == ("wsd", 0.3, 1e-4)
  for flag, value in (("--schedule", "linear"), ("--z-loss", "-1")):
    with pytest.raises(SystemExit):  # argparse: one line naming the flag, exit 2
      build_parser().parse_args(["train", "--out", "x", flag, value])
  with pytest.raises(UserError, match=r"^--decay-frac must be in \(0, 1\], got 0"):
    step_config(options("x", None, schedule="wsd", decay_frac=0.0))


TOL = 1e-11  # float64, O(d + V) terms of O(10) per value (test_loss.py)


# groups=2: the positions cut in two ranges (a sequence over context=2), T=14 into 7 + 7
@pytest.mark.parametrize("chunk,t,groups", [(5, 13, 1), (64, 13, 1), (3, 14, 2)])
def test_chunked_logsumexp_and_its_gradient_equal_the_formula(x64, chunk, t, groups):
  ks = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(ks[0], (2, t, 16), jnp.float64)
  w = jax.random.normal(ks[1], (16, 37), jnp.float64) * 0.5
  tg = jax.random.randint(ks[2], (2, t), 0, 37)
  mask = jax.random.bernoulli(ks[3], 0.8, (2, t))
  z = 0.3

  def formula(x, w):  # plain jnp: log-softmax pieces written out
    logits = jnp.einsum("btd,dv->btv", x, w)
    lse = jnp.log(jnp.sum(jnp.exp(logits), -1))
    nll = lse - jnp.take_along_axis(logits, tg[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(mask, nll + z * lse**2, 0.0))

  def chunked(x, w):
    nll, lse = chunked_token_nll_lse(x, w, tg, mask, chunk, groups=groups)
    return jnp.sum(nll) + z * jnp.sum(lse**2)

  def whole(x, w):
    nll, lse = token_nll_lse(jnp.einsum("btd,dv->btv", x, w), tg, mask)
    return jnp.sum(nll) + z * jnp.sum(lse**2)

  want = jax.value_and_grad(formula, argnums=(0, 1))(x, w)
  for fn in (chunked, whole):
    value, grads = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(value, want[0], rtol=TOL)
    for a, b in zip(grads, want[1]):
      np.testing.assert_allclose(a, b, rtol=0, atol=TOL * max(1.0, float(jnp.abs(b).max())))


F64 = Execution(dtype="float64", param_dtype="float64")


def test_z_loss_in_the_train_step(x64):
  """One compiled step (a second, without the z-loss, would double the test's compile): its
  loss and z_loss against an independent forward's NLL and logsumexp. That the z-term's
  gradient is right is the chunked logsumexp test above; the step differentiates the very sum
  it reports as `loss` (step.py's value_and_grad of the objective)."""
  rng = np.random.default_rng(0)
  rows = [(rng.integers(0, 256, 33), np.ones(33, np.int32)) for _ in range(4)]
  batch = rows_batch(rows)
  params, bias = step_lib.init_params(MICRO, F64, 0)
  sc = step_config(options("unused", None))
  w = 1e-2
  steps = step_lib.build(MICRO, F64, sc, objective=step_lib.TokenNLL(z_loss=w))
  state = steps.init(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, bias),
                     step_lib.new_rng(0))
  _, with_z = steps.train(state, batch, step_lib.NO_QK_CLIP)
  graphdef = steps.graphdef

  @jax.jit
  def logits_of(params, bias, inputs, segment_ids):
    model = nnx.merge(graphdef, nnx.State(params), nnx.State(bias))
    return model(inputs, segment_ids=segment_ids).logits

  logits = np.asarray(logits_of(params, bias, batch["inputs"][0], batch["segment_ids"][0]),
                      np.float64)
  lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  targets = np.asarray(batch["targets"][0])
  nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  m = np.asarray(batch["loss_mask"][0]).astype(bool)
  want_z = w * float(np.sum(lse[m] ** 2)) / m.sum()
  np.testing.assert_allclose(float(with_z["z_loss"]), want_z, rtol=1e-10)
  np.testing.assert_allclose(float(with_z["loss"]), float(np.sum(nll[m])) / m.sum() + want_z,
                             rtol=1e-10)
