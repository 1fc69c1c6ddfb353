"""splitmix64's output function: a cheap, well-spread 64-bit integer hash, stable across runs
and machines. Seeded sampling keys its noise with it, and the fake runner its tokens."""

GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_MASK64 = (1 << 64) - 1


def row_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for a seeded request's draw at output ``position``."""
    return mix64(seed * GOLDEN_GAMMA + position + 1)


def mix64(x: int) -> int:
    """The hash of the 64-bit integer ``x`` (taken modulo 2**64)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
