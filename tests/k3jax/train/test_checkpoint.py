"""A save that never finished leaves Orbax's temporary folder beside the committed steps: the
next run names it, skips it and resumes from the last complete checkpoint."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.train.checkpoint import TMP_SUFFIX, Checkpointer


def test_a_half_written_checkpoint_is_named_and_skipped(tmp_path, capsys):
  directory = str(tmp_path / "checkpoints")
  state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(4, jnp.int32)}
  ckpt = Checkpointer(directory, keep=3, async_save=False)
  ckpt.save(4, state, {0: {"position": 17}}, {"tokens": 128})
  ckpt.close()
  # what a process killed in the middle of saving step 6 leaves: the temporary folder of the
  # save, some of its items written, never renamed to "6"
  partial = os.path.join(directory, f"6{TMP_SUFFIX}-1796390000")
  shutil.copytree(os.path.join(directory, "4"), partial)
  shutil.rmtree(os.path.join(partial, "meta"))
  capsys.readouterr()

  ckpt = Checkpointer(directory, keep=3, async_save=False)
  err = capsys.readouterr().err
  assert f"{partial}: a checkpoint left half-written" in err, err
  assert ckpt.latest_step() == 4 and ckpt.all_steps() == [4]
  assert not os.path.exists(partial)
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  got, data, meta = ckpt.restore(4, target)
  ckpt.close()
  np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
  assert (int(got["step"]), data, meta) == (4, {"0": {"position": 17}}, {"tokens": 128})
