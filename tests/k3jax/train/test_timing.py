"""Where a step's time goes (k3jax/train/stepper.py, goodput.py, flops.py): every metrics line
has the timing keys; the loop reads a step's metrics only after the next step is queued; MFU's
peak comes from the chip table, the flag or a measurement (peak_source); goodput and badput by
cause in the summary, work lost to a restart counted; --profile-steps writes a trace, and
refuses steps outside the run; TensorBoard gets the new series."""

import os
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from k3jax.chips import CHIPS, device_chip
from k3jax.errors import UserError
from k3jax.train import flops, stepper
from k3jax.train.loop import run
from k3jax.train.metrics import read_records

from .helpers import micro_config_file, options

TIMING = ("data_wait_s", "host_to_device_s", "device_s", "checkpoint_block_s", "step_time_s")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
  return micro_config_file(tmp_path_factory.mktemp("cfg"))


def tensorboard_tags(folder) -> set[str]:
  """The scalar tags of the TFRecord event files in `folder`."""
  tags = set()
  for name in os.listdir(folder):
    with open(os.path.join(folder, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      tags |= {v.tag for v in event.summary.value}
      pos += 12 + length + 4
  return tags


def test_timing_keys_one_step_late_goodput_and_tensorboard(config_file, tmp_path, monkeypatch):
  batches, seen = stepper.next_batch, []

  def counted(run_, iterator):
    seen.append(1)
    return batches(run_, iterator)

  monkeypatch.setattr(stepper, "next_batch", counted)
  at_write = {}
  summary = run(options(tmp_path, config_file, steps=5, save_every=2, eval_every=100,
                        tensorboard=True), on_step=lambda s, r: at_write.setdefault(s, len(seen)))
  records = read_records(str(tmp_path))
  for r in records:
    assert all(r[k] >= 0 for k in TIMING), r
    assert (r["checkpoint_block_s"] > 0) == (r["step"] in (2, 4, 5)), r
  # a step's line is written once the next batch is in and the next step queued, but at a
  # step that saves (2, 4) or ends the run (5): then at once
  assert at_write == {1: 2, 2: 2, 3: 4, 4: 4, 5: 5}
  assert summary["peak_source"] == "flag"  # options() gives --peak-tflops 1
  assert 0 < summary["goodput"] <= 1 and summary["wall_s"] > 0
  badput = summary["badput_s"]
  assert set(badput) == {"compile", "data_wait", "checkpoint", "lost_to_restarts", "other"}
  assert badput["compile"] > 0 and badput["checkpoint"] > 0 and badput["lost_to_restarts"] == 0
  assert {*TIMING, "mfu", "tokens_per_s", "loss"} <= tensorboard_tags(tmp_path / "tb")


def test_work_after_the_last_checkpoint_is_counted_lost(config_file, tmp_path):
  first = run(options(tmp_path, config_file, steps=3, save_every=2))
  assert first["checkpoints"] == [2, 3]
  os.rename(tmp_path / "checkpoints" / "3", tmp_path / "gone")  # as if killed before saving 3
  again = run(options(tmp_path, config_file, steps=4, save_every=2))
  assert again["start_step"] == 2
  assert again["badput_s"]["lost_to_restarts"] > 0  # step 3, computed twice


def test_the_peak_mfu_divides_by():
  assert device_chip("NVIDIA H100 80GB HBM3") is CHIPS["h100"]
  assert device_chip("NVIDIA H100 PCIe") is CHIPS["h100-pcie"]
  assert device_chip("NVIDIA H200") is CHIPS["h200"]
  assert device_chip("TPU v5 lite") is CHIPS["v5e"] and device_chip("TPU v5p") is CHIPS["v5p"]
  assert device_chip("cpu") is None and device_chip("NVIDIA A100-SXM4-40GB") is None
  assert CHIPS["h100"].peak_flops == 989.5e12  # dense bf16: half the sparse datasheet figure
  assert flops.device_peak(2.5, np.float32) == (2.5e12, flops.PeakSource.FLAG)
  peak, source = flops.device_peak(None, np.float32)  # this CPU: measured
  assert source == flops.PeakSource.MEASURED and peak > 0


def test_the_chip_table_gives_the_peak(monkeypatch):
  monkeypatch.setattr(flops, "device_chip", lambda kind: CHIPS["h200"])
  assert flops.device_peak(None, np.float32) == (989.5e12, flops.PeakSource.CHIP)


def test_profile_steps_write_a_trace_and_refuse_steps_outside_the_run(config_file, tmp_path):
  run(options(tmp_path, config_file, steps=3, profile_steps=(2, 3)))
  traces = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "profile" / "process_0")
            for f in files if f.endswith(".xplane.pb")]
  assert traces and os.path.getsize(traces[0]) > 0
  with pytest.raises(UserError, match=r"^--profile-steps 3:9 is outside the run's steps 1-4"):
    run(options(tmp_path / "bad", config_file, steps=4, profile_steps=(3, 9)))
  with pytest.raises(UserError, match=r"^--profile-steps 2:4 is outside the run: it resumes "
                                      r"after step 3"):
    run(options(tmp_path, config_file, steps=4, profile_steps=(2, 4)))
  assert not (tmp_path / "bad").exists()
