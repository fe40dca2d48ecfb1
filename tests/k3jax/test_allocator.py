"""k3jax.allocator: finding tcmalloc, telling which allocator runs, and the re-exec that
preloads it (checked with a stand-in library path: the child sees the preload and the opt-out
that stops a second re-exec)."""

import json
import os
import subprocess
import sys

from k3jax import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_find_tcmalloc_looks_in_the_given_dirs(tmp_path):
  assert allocator.find_tcmalloc([str(tmp_path)]) is None
  lib = tmp_path / "libtcmalloc_minimal.so.4"
  lib.write_bytes(b"")
  assert allocator.find_tcmalloc([str(tmp_path / "absent"), str(tmp_path)]) == str(lib)


def test_active_reads_the_process_maps(tmp_path):
  maps = tmp_path / "maps"
  maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
  assert allocator.active(str(maps)) == "system"
  maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libtcmalloc_minimal.so.4.5.9\n")
  assert allocator.active(str(maps)) == "tcmalloc"
  assert allocator.active(str(tmp_path / "no-such-file")) == "system"


def _run(code, env):
  return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


def test_reexec_preloads_the_library_once(tmp_path):
  fake = str(tmp_path / "libtcmalloc_minimal.so.4")  # not a library: ld.so skips it with a note
  open(fake, "wb").close()
  child = ("import json, os; print(json.dumps([os.environ.get('LD_PRELOAD'), "
           "os.environ.get('K3JAX_ALLOCATOR')]))")
  parent = (f"from k3jax import allocator; allocator.reexec_with_tcmalloc(['-c', {child!r}], "
            f"lib={fake!r}); print('not re-executed')")
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "K3JAX_ALLOCATOR")}
  env["PYTHONPATH"] = ROOT
  r = _run(parent, env)
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout.strip().splitlines()[-1]) == [fake, "system"]
  # opted out: the same call returns and the script goes on under the system allocator
  r = _run(parent, {**env, "K3JAX_ALLOCATOR": "system"})
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "not re-executed"
