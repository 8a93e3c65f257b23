"""What the kernels' tests share: CUDA's bit instructions, replayed in Python."""


def byte_perm(a: int, b: int, selector: int) -> int:
    """CUDA's ``__byte_perm``: bytes 0-3 of ``a`` then 4-7 of ``b``, picked by nibbles."""
    source = a | (b << 32)
    return sum(((source >> (8 * ((selector >> (4 * i)) & 0xF))) & 0xFF) << (8 * i) for i in range(4))
