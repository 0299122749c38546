"""What a tensor must satisfy to be read or written through a TMA descriptor (both templates)."""

import torch


def tma_aligned(t: torch.Tensor) -> bool:
    """Unit last stride, 16-byte aligned base address and 16-byte aligned outer strides.

    Example::

        >>> tma_aligned(torch.empty(4, 64, dtype=torch.float16))
        True
    """
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 for s in t.stride()[:-1]))
