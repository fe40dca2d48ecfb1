"""PNG plots of a run, drawn from its metrics.jsonl at the end (matplotlib, Agg: no display).

  OUT/plots/loss.png         train loss per step, eval loss at its steps
  OUT/plots/expert_load.png  per MoE layer (moving averages): max/mean expert load as routed,
                             the same for the next bias on the same tokens, and the fraction of
                             dead experts

`plot_panels` draws any grid of per-step metrics (k3jax rl's OUT/plots/rl.png).
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless, file output only
import matplotlib.pyplot as plt


def _series(records: list[dict], key: str) -> tuple[list[int], list]:
  pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_loss(records: list[dict], path: str) -> None:
  fig, ax = plt.subplots(figsize=(7, 4))
  steps, loss = _series(records, "loss")
  ax.plot(steps, loss, lw=1, label="train")
  e_steps, e_loss = _series(records, "eval_loss")
  if e_steps:
    ax.plot(e_steps, e_loss, "o-", ms=3, label="eval (held out)")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats / token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _smooth(values: list[float], window: int) -> list[float]:
  """Trailing moving average (per-step QB loads are noisy; the trend is what matters)."""
  out, acc = [], 0.0
  for i, v in enumerate(values):
    acc += v
    if i >= window:
      acc -= values[i - window]
    out.append(acc / min(i + 1, window))
  return out


def plot_expert_load(records: list[dict], path: str) -> None:
  steps, before = _series(records, "load_max_mean_before")
  _, after = _series(records, "load_max_mean_after")
  _, dead = _series(records, "dead_before")
  window = max(1, len(steps) // 40)
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharex=True)
  titles = ("max / mean expert load, as routed (bias b_t)",
            "max / mean load the next bias b_t+1 gives the same tokens",
            "fraction of dead experts (as routed)")
  if before:
    n_layers = len(before[0])
    cmap = plt.get_cmap("viridis", max(n_layers, 2))
    for layer in range(n_layers):
      for ax, series in zip(axes, (before, after, dead)):
        ax.plot(steps, _smooth([x[layer] for x in series], window), color=cmap(layer), lw=1,
                label=f"MoE layer {layer}")
    axes[0].legend(fontsize=7, ncol=2)
    top = max(max(max(b) for b in before), max(max(a) for a in after))
    axes[0].set_ylim(0.9, top * 1.05)
    axes[1].set_ylim(0.9, top * 1.05)
  for ax, title in zip(axes, titles):
    ax.set_title(title + (f", {window}-step mean" if window > 1 else ""), fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0].axhline(1.0, color="k", lw=0.5)
  axes[1].axhline(1.0, color="k", lw=0.5)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_panels(records: list[dict], panels, path: str, columns: int = 3) -> None:
  """A grid of per-step line plots: `panels` is a sequence of (title, [(metric key, label),
  ...]); a key absent from every record leaves its line out (k3jax rl's plot)."""
  rows = -(-len(panels) // columns)
  fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.3 * rows), squeeze=False)
  for ax, (title, lines) in zip(axes.flat, panels):
    for key, label in lines:
      steps, values = _series(records, key)
      if steps:
        ax.plot(steps, values, lw=1, marker="o" if len(steps) < 30 else None, ms=2,
                label=label)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(lines) > 1:
      ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_plots(records: list[dict], out_dir: str) -> list[str]:
  folder = os.path.join(out_dir, "plots")
  os.makedirs(folder, exist_ok=True)
  paths = [os.path.join(folder, "loss.png"), os.path.join(folder, "expert_load.png")]
  plot_loss(records, paths[0])
  plot_expert_load(records, paths[1])
  return paths
