"""MXFP4 (OCP microscaling FP4, E2M1 elements, E8M0 scales, group 32 along the input dim).

    w[o, 2j]   = E2M1[packed[o, j] & 0xF] * 2^(scale[o, 2j // 32] - 127)
    w[o, 2j+1] = E2M1[packed[o, j] >> 4]  * 2^(scale[o, (2j+1) // 32] - 127)

Every MXFP4 value is exactly representable in bf16 (3 significant bits, exponent within bf16's
range), so dequantising to bf16 loses nothing.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
  """uint8 codes [out, in/2] and uint8 E8M0 scales [out, in/32] -> weights [out, in]."""
  packed = np.asarray(packed)
  scale = np.asarray(scale)
  if packed.dtype != np.uint8 or scale.dtype != np.uint8:
    raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
  out, half = packed.shape
  if scale.shape != (out, 2 * half // GROUP) or (2 * half) % GROUP:
    raise ValueError(f"MXFP4 scale shape {scale.shape} does not fit codes {packed.shape}")
  codes = np.empty((out, 2 * half), np.uint8)
  codes[:, 0::2] = packed & 0xF
  codes[:, 1::2] = packed >> 4
  # 2^(s-127) built from its bits: exact for every E8M0 value that float32 can hold.
  factor = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
  w = E2M1[codes] * np.repeat(factor, GROUP, axis=1)
  return w.astype(dtype)
