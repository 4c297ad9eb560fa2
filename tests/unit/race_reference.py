"""The race noise written out in plain Python integers (a second implementation, for tests): murmur3's fmix32 on
unsigned 32-bit values, and a uniform with 23 random bits."""

import math

M32 = 0xFFFFFFFF


def fmix32(z: int) -> int:
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & M32
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & M32
    return z ^ (z >> 16)


def reference_exponential(key: tuple[int, int], token: int) -> float:
    """E(key, token): z = fmix32(fmix32(token * 0x9E3779B9 + k1) ^ k2), its top 23 bits as w in (0, 1), -log(1 - w)."""
    k1, k2 = key[0] & M32, key[1] & M32
    z = fmix32(fmix32((token * 0x9E3779B9 + k1) & M32) ^ k2)
    return -math.log1p(-((z >> 9) + 0.5) / (1 << 23))
