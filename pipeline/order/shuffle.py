"""The shuffle's pure functions: an epoch's key from (seed, epoch) and a keyed permutation of
[0, n) applied to any positions (a Feistel bijection with cycle walking: O(1) memory, no
shuffle buffer). `pipeline.order.sampling` deals it out to the processes; `pipeline.order.blocks`
permutes blocks with it.
"""

import numpy as np

PAD = -1  # the index of a padding position (masked out)
ROUNDS = 4


# splitmix64's constants as numpy scalars, made once: a batch's plan calls `_mix` ~40 times
_GAMMA, _M1, _M2 = map(np.uint64, (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_S30, _S27, _S31 = map(np.uint64, (30, 27, 31))


def _mix(z: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer on uint64 (wrapping arithmetic)."""
  z = z + _GAMMA
  z = (z ^ (z >> _S30)) * _M1
  z = (z ^ (z >> _S27)) * _M2
  return z ^ (z >> _S31)


def epoch_key(seed: int, epoch: int) -> int:
  """The key of an epoch's shuffle."""
  return seed << 32 | epoch % 2**32


def permute(x: np.ndarray, n: int, key: int) -> np.ndarray:
  """A pseudo-random permutation of [0, n) chosen by `key`, applied to each element of `x`.

  An unbalanced Feistel network on the smallest power of two >= n, cycle-walked back into
  [0, n) (fewer than 2 passes on average).
  """
  x = np.asarray(x, np.uint64)
  if n <= 1:
    return x.astype(np.int64)
  bits = max(2, (n - 1).bit_length())
  with np.errstate(over="ignore"):
    keys = _mix(np.arange(ROUNDS, dtype=np.uint64) * np.uint64(2**61 - 1) + np.uint64(key))

    half = (bits // 2, bits - bits // 2)  # bits of left and right
    shift = [np.uint64(h) for h in half]
    mask = [np.uint64((1 << h) - 1) for h in half]

    def once(v: np.ndarray) -> np.ndarray:
      a, b = 0, 1  # which half is left, which right
      left, right = v >> shift[b], v & mask[b]
      for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask[a])
        a, b = b, a
      return (left << shift[b]) | right

    out = once(x)
    outside = np.flatnonzero(out >= np.uint64(n))
    while len(outside):  # cycle walking
      out[outside] = once(out[outside])
      outside = outside[out[outside] >= np.uint64(n)]
  return out.astype(np.int64)
