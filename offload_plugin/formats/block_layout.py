"""Which parameters a block-wise 8-bit state (CompactAdamW's, AdamW8bit's) takes, and the
shape of their block scales, for whole parameters and for FSDP2 shards alike.

A whole parameter is in 8 bits from ``min_8bit_size`` elements on, its scales one flat run of a
scale per block. One rank's rows of a sharded parameter must get a layout every rank agrees on
and that a checkpoint reshards by rows: it is in 8 bits only if the full parameter has at
least ``min_8bit_size`` elements, two or more dims, and rows of whole blocks; its scales are
then kept per row, ``(rows, blocks per row)``, and shard with the rows. The rest takes the
optimizer's fp32 layout.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BlockLayout"]


class BlockLayout:
    """The rule above for one optimizer, with blocks of ``block`` elements; it keeps the full
    shapes of the parameters it was told are shards (``shard_of``)."""

    def __init__(self, block: int, full_shapes: dict | None = None, first_rows: dict | None = None) -> None:
        self.block = block
        self.full_shapes: dict[torch.Tensor, torch.Size] = dict(full_shapes or {})
        self.first_rows: dict[torch.Tensor, int] = dict(first_rows or {})

    def shard_of(self, p: torch.Tensor, full_shape, first_row: int = 0) -> None:
        """``p`` is this rank's rows (a dim-0 shard, as FSDP2 makes) of a parameter of
        ``full_shape``, from row ``first_row`` on."""
        self.full_shapes[p] = torch.Size(full_shape)
        self.first_rows[p] = int(first_row)

    def place(self, p: torch.Tensor) -> tuple[int, int]:
        """(where ``p``'s first element lies in its parameter, the parameter's elements)."""
        full = self.full_shapes.get(p)
        if full is None:
            return 0, p.numel()
        return self.first_rows.get(p, 0) * math.prod(full[1:]), math.prod(full)

    def is_shard(self, p: torch.Tensor) -> bool:
        return p in self.full_shapes

    def eight_bit_when_new(self, p: torch.Tensor, min_8bit_size: int) -> bool:
        """Whether ``p``, without state, gets the 8-bit layout."""
        full = self.full_shapes.get(p)
        if full is None:
            return p.numel() >= min_8bit_size
        return len(full) >= 2 and math.prod(full) >= min_8bit_size and math.prod(full[1:]) % self.block == 0

    def scale_shape(self, p: torch.Tensor) -> tuple:
        """The shape of ``p``'s block scales: per row for a shard, else one flat run."""
        full = self.full_shapes.get(p)
        if full is None:
            return (-(-p.numel() // self.block),)
        return (p.shape[0], math.prod(full[1:]) // self.block)
