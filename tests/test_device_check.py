"""benchmarks/device_check.py, the one command of a GPU window: its CPU dry run end to end (every
section in its own process, the Pallas kernels in interpret mode, their numerics against the
float64 chunked reference), the JSON it writes, and the driver's isolation of a section that
fails or hangs (with stand-in sections that need no JAX).
"""

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from benchmarks import device_check

ROOT = pathlib.Path(__file__).parents[1]
COMPARISON = {"max_abs_err", "max_err_over_tol", "within_tol"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("dry")
  proc = subprocess.run([sys.executable, "benchmarks/device_check.py", "--dry-run", "--out",
                         str(out), "--budget-s", "900"], cwd=ROOT, capture_output=True,
                        text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return json.loads((out / "device_check.json").read_text()), out, proc.stdout


def test_every_section_runs_or_is_skipped_for_its_reason(dry_run):
  report, out, stdout = dry_run
  assert {"command", "date", "dry_run", "budget_s", "sizes", "sections", "elapsed_s"} <= set(
      report)
  assert report["dry_run"] is True
  sections = report["sections"]
  assert list(sections) == list(device_check.SECTIONS)
  status = {name: s["status"] for name, s in sections.items()}
  assert status == {**dict.fromkeys(device_check.SECTIONS, "ok"), "kda_fla": "skipped"}, {
      name: (s["status"], s.get("failed_parts"), s.get("output_tail")) for name, s in
      sections.items()}
  log = (out / "device_check.log").read_text()
  for name in device_check.SECTIONS:
    assert f"== {name}: {status[name]}" in log and f"== {name}: {status[name]}" in stdout
  assert "[kda_check]" in log  # the sections' own output
  assert "train           MFU vs chip (vs measured peak)" in stdout  # the table


def test_kda_kernels_match_the_float64_chunked_reference_in_interpret_mode(dry_run):
  check = dry_run[0]["sections"]["kda_check"]
  assert check["within_tol"] is True
  outputs = {"forward": {"o", "final_state"}, "decode": {"o", "state"},
             "gradient": {"dq", "dk", "dv", "dg", "dbeta", "dh0"}}
  assert set(check["results"]) == {"pallas_mosaic_gpu", "pallas_gpu"}
  for backend in check["results"].values():
    for what, names in outputs.items():
      result = backend["float32"][what]
      assert set(result) == names | {"seconds_with_compile"}
      for name in names:
        assert set(result[name]) == COMPARISON and result[name]["within_tol"], (what, name)
        assert 0 < result[name]["max_err_over_tol"] <= 1  # compared, not vacuously equal


def test_timings_and_their_ratios(dry_run):
  s = dry_run[0]["sections"]
  for mode in ("fwd", "fwd_bwd"):
    r = s["kda_speed"]["results"]["xla_cpu"][mode]
    assert r["seconds"] > 0 and r["compile_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(64 / r["seconds"])
  gmm = s["grouped_matmul"]["results"]
  assert set(gmm) == {"dense", "ragged_dot", "tiled", "dense_dx", "mxfp4_tiled"}
  for impl in ("ragged_dot", "tiled", "mxfp4_tiled"):
    base = "dense_dx" if impl == "mxfp4_tiled" else "dense"
    assert gmm[impl]["fwd_bwd"]["over_dense"] == pytest.approx(
        gmm[impl]["fwd_bwd"]["seconds"] / gmm[base]["fwd_bwd"]["seconds"])
  device = s["device"]
  assert device["platform"] == "cpu" and device["chip"] is None
  assert device["hbm_bandwidth"] > 0 and device["matmul_peak"] > 0
  assert device["versions"]["jax"]


def test_train_mfu_and_decode_against_the_weights_bound(dry_run):
  s = dry_run[0]["sections"]
  train = s["train"]["results"]
  assert train["mfu_vs_chip_peak"] is None  # a CPU is not in the chip table
  assert 0 < train["mfu"] < 1 and train["step_s"] > 0 and train["tokens_per_step"] == 64
  decode, setup = s["decode"]["results"], s["decode"]["setup"]
  assert set(decode) == {"2"}
  bound = setup["active_weight_bytes"] / s["device"]["hbm_bandwidth"]
  assert decode["2"]["weights_bound_s"] == pytest.approx(bound)
  assert decode["2"]["over_bound"] == pytest.approx(decode["2"]["step_s"] / bound)


# ---- the driver, with stand-in sections ------------------------------------------------------

STAND_IN = textwrap.dedent("""
  import json, os, sys, time
  name, out = sys.argv[sys.argv.index("--section") + 1], sys.argv[sys.argv.index("--out") + 1]
  def save(data):
    with open(os.path.join(out, "sections", name + ".json"), "w") as f:
      json.dump(data, f)
  if name == "device":      # crashes after saving a part
    save({"hbm_bandwidth": 1.0})
    print("boom", flush=True)
    sys.exit(3)
  if name == "kda_check":   # hangs after saving a part
    save({"results": {"a": 1}})
    print("compiling", flush=True)
    time.sleep(60)
  if name == "kda_speed":   # one part failed, the section went on
    save({"results": {"x": {"fwd": {"error": "ValueError: bad"}, "fwd_bwd": {"seconds": 1}}}})
""")


def test_a_failed_or_hung_section_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
  script = tmp_path / "stand_in.py"
  script.write_text(STAND_IN)
  monkeypatch.setattr(device_check, "HERE", str(script))
  monkeypatch.setattr(device_check, "MIN_SECTION_S", 0.2)
  out = tmp_path / "out"
  device_check.main(["--out", str(out), "--budget-s", "13",
                     "--sections", "device,kda_check,kda_speed,grouped_matmul"])
  report = json.loads((out / "device_check.json").read_text())
  s = report["sections"]
  assert s["device"]["status"] == "failed" and s["device"]["exit_code"] == 3
  assert s["device"]["hbm_bandwidth"] == 1.0 and s["device"]["output_tail"] == ["boom"]
  assert s["kda_check"]["status"] == "timeout" and s["kda_check"]["results"] == {"a": 1}
  assert s["kda_check"]["seconds"] < 8 and s["kda_check"]["output_tail"] == ["compiling"]
  assert s["kda_speed"]["status"] == "partial"
  assert s["kda_speed"]["failed_parts"] == {"results/x/fwd": "ValueError: bad"}
  assert s["grouped_matmul"]["status"] == "ok"
  assert report["elapsed_s"] < 13


def test_a_budget_too_short_skips_the_sections(tmp_path):
  device_check.main(["--out", str(tmp_path), "--budget-s", "4"])
  report = json.loads((tmp_path / "device_check.json").read_text())
  assert {s["status"] for s in report["sections"].values()} == {"skipped"}
  assert report["sections"]["train"]["why"].startswith("budget")


def test_record_keeps_a_failed_part_and_goes_on(tmp_path):
  (tmp_path / "sections").mkdir()
  rec = device_check.Record(str(tmp_path), "x")
  with rec.part("results/a"):
    raise RuntimeError("no kernel\nsecond line")
  with rec.part("results/b"):
    rec.put("results/b/seconds", 2.0)
  saved = json.loads((tmp_path / "sections" / "x.json").read_text())
  assert saved == {"results": {"a": {"error": "RuntimeError: no kernel"}, "b": {"seconds": 2.0}}}
  assert dict(device_check.errors(saved)) == {"results/a": "RuntimeError: no kernel"}
